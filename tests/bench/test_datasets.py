"""Arrival process statistics (fixed seeds) and dataset shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.datasets import (
    FIRST_PROMPT_ID,
    arrival_offsets,
    length_range,
    mixed_requests,
    random_requests,
)


@pytest.mark.parametrize("rate,burstiness", [(10.0, 1.0), (4.0, 0.25), (50.0, 4.0)])
def test_gamma_gaps_have_the_asked_mean_and_spread(rate, burstiness):
    t = np.asarray(arrival_offsets(40001, rate, burstiness, seed=7))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Gamma(shape=b): coefficient of variation 1/sqrt(b); 1 for Poisson.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_poisson_counts_per_window():
    rate = 20.0
    t = np.asarray(arrival_offsets(60001, rate, 1.0, seed=3))
    counts = np.bincount(t.astype(int))[:-1]  # whole one-second windows
    assert counts.mean() == pytest.approx(rate, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)  # Poisson: var = mean
    # Memoryless: P(gap > 1/rate) = e^-1.
    assert np.mean(np.diff(t) > 1 / rate) == pytest.approx(math.exp(-1), abs=0.01)


def test_arrivals_seeded_and_inf():
    assert arrival_offsets(5, 3.0, 1.0, seed=1) == arrival_offsets(5, 3.0, 1.0, seed=1)
    assert arrival_offsets(5, 3.0, 1.0, seed=1) != arrival_offsets(5, 3.0, 1.0, seed=2)
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    assert arrival_offsets(0, 1.0) == []
    for bad in ((3, 0.0, 1.0), (3, 1.0, 0.0), (3, -1.0, 1.0)):
        with pytest.raises(ValueError):
            arrival_offsets(*bad)


def test_random_requests_lengths_and_ids():
    reqs = random_requests(200, 100, 20, vocab_size=500, range_ratio=0.5, seed=1)
    assert reqs == random_requests(200, 100, 20, vocab_size=500, range_ratio=0.5, seed=1)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 20
    assert min(outs) >= 10 and max(outs) <= 30
    for r in reqs:
        assert len(r.prompt) == r.prompt_len
        assert all(FIRST_PROMPT_ID <= t < 500 for t in r.prompt)
    fixed = random_requests(3, 16, 4, vocab_size=100, seed=0)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(16, 4)] * 3
    assert length_range(10, 0.0) == (10, 10)
    with pytest.raises(ValueError):
        length_range(10, 1.0)


def test_mixed_requests_share_and_lengths():
    reqs = mixed_requests(50, vocab_size=300, long_ratio=0.2, long_input_len=400,
                          long_output_len=4, short_input_len=20, short_output_len=30, seed=5)
    long = [r for r in reqs if r.kind == "long"]
    short = [r for r in reqs if r.kind == "short"]
    assert len(long) == 10 and len(short) == 40
    assert {(r.prompt_len, r.output_len) for r in long} == {(400, 4)}
    assert {(r.prompt_len, r.output_len) for r in short} == {(20, 30)}
    kinds = [r.kind for r in reqs]
    assert kinds != sorted(kinds)  # spread among the chats, not bunched
    assert kinds == [r.kind for r in mixed_requests(50, vocab_size=300, long_ratio=0.2,
                                                    long_input_len=400, long_output_len=4,
                                                    short_input_len=20, short_output_len=30,
                                                    seed=5)]


def test_text_prompts_use_the_tokenizer():
    class Tok:  # one character per id, re-encoded one token per character
        def decode(self, ids):
            return "".join(chr(65 + i % 26) for i in ids)

        def encode(self, text):
            return [1] + [ord(c) for c in text]  # with a BOS, as a real one may add

    reqs = random_requests(2, 12, 3, vocab_size=100, seed=0, prompt_format="text", tokenizer=Tok())
    assert all(isinstance(r.prompt, str) and len(r.prompt) == 12 for r in reqs)
    assert [r.prompt_len for r in reqs] == [13, 13]  # the re-encoded length
    with pytest.raises(ValueError):
        random_requests(1, 4, 1, vocab_size=100, prompt_format="text")


def test_prefix_requests_share_prefixes_and_order_conversations():
    from pdserve.bench.datasets import prefix_requests

    reqs = prefix_requests(30, vocab_size=4096, system_len=64, question_len=8,
                           num_system_prompts=2, turns=3, turn_len=16, output_len=4, seed=3)
    assert len(reqs) == 30
    assert prefix_requests(30, vocab_size=4096, system_len=64, question_len=8,
                           num_system_prompts=2, turns=3, turn_len=16, output_len=4,
                           seed=3) == reqs  # seeded
    kinds = {r.kind for r in reqs}
    assert kinds == {"first", "shared", "cold", "turn"}
    shared = [r for r in reqs if r.kind in ("first", "shared") and r.prompt_len == 72]
    systems = {tuple(r.prompt[:64]) for r in shared}
    assert len(systems) == 2  # every shared prompt starts with one of the 2 system prompts
    cold = [r for r in reqs if r.kind == "cold"]
    assert cold and all(r.prompt_len == 72 for r in cold)
    assert not {tuple(r.prompt[:64]) for r in cold} & systems
    for i, r in enumerate(reqs):
        assert r.prompt_len == len(r.prompt)
        if r.kind == "turn":  # after its conversation's previous turn, whose prompt it extends
            prev = reqs[r.after]
            assert r.after < i and r.prompt[:prev.prompt_len] == prev.prompt
            assert r.prompt_len == prev.prompt_len + 4 + 16  # + reply + new user message
