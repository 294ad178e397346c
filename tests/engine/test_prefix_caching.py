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


def _engine(model_dir, engine_type, **kw):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model_dir=model_dir, engine_type=engine_type, **kw))


def _run(engine, limit=300):
    tokens, handoffs = {}, []
    for _ in range(limit):
        if not engine.has_work():
            return tokens, handoffs
        step = engine.step()
        for out in step.outputs:
            tokens.setdefault(out.attempt, []).extend(out.new_token_ids)
        handoffs += step.handoffs
    raise AssertionError("did not drain")


def test_a_decode_rank_holding_the_prefix_imports_only_the_rest(model_dirs, hf_greedy):
    """The hand-off leaves out the blocks the decode engine's cache holds (named when
    it imported the first request); the rest imports into fresh blocks after them and
    decodes to transformers' tokens. A prefix the cache lost is refused (CacheMissError)
    with nothing taken."""
    from pdserve.engine.engine import CacheMissError
    from pdserve.engine.kv.payload import KVPayload

    model_dir = model_dirs["llama"]
    # 71 shared tokens: 4 full blocks (a seed whose greedy outputs hold no EOS, which
    # the reference suppresses and ignore_eos keeps)
    prompts = shared_prefix_prompts(seed=11, num=2)
    want = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    prefill, decode = _engine(model_dir, "prompt"), _engine(model_dir, "completion")
    got = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, GREEDY)
        _, handoffs = _run(prefill)
        h = handoffs[0]
        payload = KVPayload.from_bytes(h.payload)
        if i == 1:
            assert h.num_cached_tokens == 64  # the prefill rank's own cache
            whole = len(h.payload)
            payload = payload.without_prefix(4)  # what the decode rank holds
            assert len(payload.to_bytes()) < whole * 0.6
        decode.import_prefilled(payload.to_bytes())
        tokens, _ = _run(decode)
        got[i] = [h.first_token_id] + tokens[f"r{i}"]
    assert [got[0], got[1]] == want
    assert decode.stats().cache_hit_tokens == 0  # imports are not prompt lookups
    # a prefix it does not hold: refused, nothing held
    prefill.add_request("r2", [1] + [5] * 70, GREEDY)
    _, handoffs = _run(prefill)
    free = decode.scheduler.num_free_blocks
    with pytest.raises(CacheMissError):
        decode.import_prefilled(KVPayload.from_bytes(handoffs[0].payload).without_prefix(4)
                                .to_bytes())
    assert decode.scheduler.num_free_blocks == free and not decode.has_work()
    prefill.assert_drained()
    decode.assert_drained()
