"""Speculative decoding: the n-gram proposer, verification, the draft sizes the measured
costs pick, and on a small vocabulary that speculative sampling keeps the target
distribution (and the very tokens plain decoding draws)."""

from __future__ import annotations

import torch

from pdserve.engine.speculative.decoding import (
    PROBE_EVERY,
    NgramProposer,
    Speculator,
    StepCosts,
    expected_tokens,
)
from pdserve.kernels.sampling import sample
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.scheduler.sequence import Sequence


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(min_n=2, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    history = [1, 2, 3, 9, 9, 7, 2, 3, 8, 8, 2, 3]
    # "2 3" ends it; the 3-gram "x 2 3" never repeats; the latest earlier "2 3" is at 6
    assert p.propose(history, 3) == [8, 8, 2]
    assert p.propose(history, 1) == [8]
    assert p.propose([1, 2, 3, 4], 3) == []  # no n-gram repeats
    assert p.propose(history, 0) == []
    # the longer match wins over a later shorter one
    history = [5, 6, 7, 1, 1, 6, 7, 2, 2, 5, 6, 7]
    assert p.propose(history, 2) == [1, 1]


def test_verify_accepts_the_drafted_tokens_that_match_and_adds_the_next():
    spec = Speculator(NgramProposer(), 4, max_model_len=100)
    seq = Sequence("a", [1, 2, 3])
    seq.draft_token_ids = [5, 6, 7]
    assert spec.verify(seq.attempt, seq.draft_token_ids, [5, 6, 9, 4]) == [5, 6, 9]
    seq.draft_token_ids = [5, 6, 7]
    assert spec.verify(seq.attempt, seq.draft_token_ids, [5, 6, 7, 4]) == [5, 6, 7, 4]
    seq.draft_token_ids = [5, 6, 7]
    assert spec.verify(seq.attempt, seq.draft_token_ids, [8, 6, 7, 4]) == [8]
    m = spec.metrics
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (3, 9, 5)
    assert m.accepted_per_pos == [2, 2, 1]


def test_costs_interpolate_and_extrapolate_linearly():
    c = StepCosts()
    assert c.estimate(3) is None
    c.observe(1, 0.010)
    assert c.estimate(1) == 0.010 and c.estimate(3) is None
    c.observe(5, 0.018)
    assert abs(c.estimate(3) - 0.014) < 1e-9
    assert abs(c.estimate(9) - 0.026) < 1e-9


def _planned(costs: dict[int, float], rows: int, drafts, steps: int = 1) -> list[int]:
    spec = Speculator(NgramProposer(), 5, max_model_len=100)
    spec.costs.times.update(costs)
    spec._steps = steps
    return spec.plan_draft_lens(rows, drafts)


def test_drafts_only_where_the_measured_costs_say_they_pay():
    # memory-bound: six rows cost little more than one, so a well-accepted draft pays
    cheap = {1: 0.006, 6: 0.009}
    assert _planned(cheap, 1, [(0.9, 5)]) == [5]
    # compute-bound: every row costs as much as the first, so no draft can pay
    linear = {1: 0.006, 6: 0.036}
    assert _planned(linear, 1, [(0.9, 5)]) == [0]
    # a poorly accepted draft does not pay even when rows are cheap
    assert _planned(cheap, 1, [(0.05, 5)]) == [0]
    # nothing measured: no draft, so the plain step gets measured first
    assert _planned({}, 1, [(0.9, 5)]) == [0]
    # only the plain step measured: a draft size is tried every PROBE_EVERY steps
    assert _planned({1: 0.006}, 1, [(0.9, 5)], steps=PROBE_EVERY) == [1]
    assert _planned({1: 0.006}, 1, [(0.9, 5)], steps=PROBE_EVERY + 1) == [0]


def test_without_adaptation_every_draft_is_checked():
    spec = Speculator(NgramProposer(), 5, max_model_len=100, adaptive=False)
    spec.costs.times.update({1: 0.006, 6: 0.036})  # drafts could not pay
    assert spec.plan_draft_lens(2, [(0.1, 5), (0.9, 3)]) == [5, 3]


def test_expected_tokens_of_a_draft():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_speculative_sampling_keeps_the_target_distribution_on_a_small_vocabulary():
    """A toy model over 6 tokens (next-token logits a fixed function of the last token).
    For 2000 seeds, decode 3 tokens plainly and speculatively (a fixed, often wrong,
    draft): the sequences are the same seed by seed, and the first emitted token's
    frequencies match the target's probabilities."""
    vocab = 6
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=gen) * 1.5

    def draw(prev: list[int], seeds: torch.Tensor, position: int) -> torch.Tensor:
        logits = table[torch.tensor(prev)]
        n = len(prev)
        return sample(logits, torch.ones(n), torch.full((n,), -1), torch.ones(n), seeds,
                      torch.full((n,), position))

    seeds = torch.arange(2000)
    plain = [torch.zeros(2000, dtype=torch.long)]
    for pos in range(3):
        plain.append(draw(plain[-1].tolist(), seeds, 10 + pos))
    plain = torch.stack(plain[1:], 1)
    spec = Speculator(NgramProposer(), 3, max_model_len=100)
    emitted_rows = []
    for i in range(2000):
        seq = Sequence(f"r{i}", [0])
        seq.draft_token_ids = [2, 2, 2]
        tokens = [0, *seq.draft_token_ids]
        drawn = [int(draw([t], seeds[i:i + 1], 10 + j)[0]) for j, t in enumerate(tokens)]
        out = spec.verify(seq.attempt, seq.draft_token_ids, drawn)
        while len(out) < 3:  # plain decoding after the first rejection
            out.append(int(draw([out[-1]], seeds[i:i + 1], 10 + len(out))[0]))
        emitted_rows.append(out[:3])
    emitted = torch.tensor(emitted_rows)
    assert torch.equal(emitted, plain)
    want = torch.softmax(table[0], -1)
    got = torch.bincount(emitted[:, 0], minlength=vocab).double() / 2000
    assert (got - want).abs().max() < 0.04, (got, want)
    assert 0 < spec.metrics.num_accepted_tokens < spec.metrics.num_draft_tokens


def test_propose_skips_sequences_near_their_limits():
    spec = Speculator(NgramProposer(min_n=1, max_n=2), 5, max_model_len=12)
    spec.costs.times.update({1: 0.006, 2: 0.0061, 6: 0.0065})
    seq = Sequence("a", [1, 2, 1, 2, 1, 2, 1], SamplingParams(max_tokens=3))
    seq.token_ids.append(2)  # one output token: two more allowed, the last not drafted
    seq.processed = len(seq) - 1
    seq.status = seq.status.__class__.RUNNING
    assert spec.propose([seq]) == [(seq, [1])]  # max_tokens 3 leaves room for one drafted token
