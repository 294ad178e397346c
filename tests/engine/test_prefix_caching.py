"""Prefix caching through the engines: prompts that share prefixes, a second round
served from the cache, greedy outputs equal to transformers' token for token, in
normal and disaggregated mode and with a pool small enough to force evictions and
preemption; afterwards every block is free (cached ones evictable, no reference)."""

from __future__ import annotations

import random

import pytest
from pdserve.engine.llm import LLM
from pdserve.scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(seed=3, num=6):
    rng = random.Random(seed)
    system = [1] + [rng.randrange(3, 4000) for _ in range(70)]  # 4 full blocks of 16, +7
    return [system + [rng.randrange(3, 4000) for _ in range(rng.randrange(1, 30))]
            for _ in range(num)]


@pytest.mark.parametrize("mode,num_kv_blocks", [("normal", None), ("disaggregated", None),
                                                ("normal", 20)],
                         ids=["normal", "disaggregated", "normal-tight"])
def test_shared_prefixes_hit_the_cache_and_match_transformers(model_dirs, hf_greedy, mode,
                                                              num_kv_blocks):
    model_dir = model_dirs["llama"]
    prompts = shared_prefix_prompts()
    want = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    llm = LLM(model_dir, mode=mode, num_kv_blocks=num_kv_blocks, max_num_seqs=4)
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)
    rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)  # second round
    assert [o.token_ids for o in first + rest] == want
    assert [o.token_ids for o in again] == want
    assert first[0].num_cached_tokens == 0
    prefill = llm.engines[0]
    if num_kv_blocks is None:
        # after the first, each takes the system prompt's 4 full blocks from the cache
        assert all(o.num_cached_tokens >= 64 for o in rest)
        assert all(o.num_cached_tokens >= 64 for o in again)
    else:
        assert prefill.stats().cache_evictions > 0  # the tight pool evicted
        assert sum(o.num_cached_tokens for o in rest + again) > 0
    for engine in llm.engines:
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks  # free or evictable
    llm.assert_drained()


def test_preemption_under_caching_keeps_greedy_parity(model_dirs, hf_greedy):
    model_dir = model_dirs["llama"]
    prompts = shared_prefix_prompts(seed=5, num=8)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = hf_greedy(model_dir, prompts, long.max_tokens)
    llm = LLM(model_dir, mode="normal", num_kv_blocks=20, max_num_seqs=8)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=long)
    assert [o.token_ids for o in outs] == want
    stats = llm.engines[0].stats()
    assert stats.num_preemptions > 0 and stats.cache_hit_tokens > 0
    assert stats.cache_evictions > 0
    llm.assert_drained()


def test_sliding_window_models_run_without_the_cache(model_dirs):
    llm = LLM(model_dirs["mistral-swa"], mode="normal")
    assert not llm.engines[0].scheduler.caching
    llm_off = LLM(model_dirs["llama"], mode="normal", enable_prefix_caching=False)
    assert not llm_off.engines[0].scheduler.caching
