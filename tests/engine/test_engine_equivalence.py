"""Greedy tokens are identical across transformers, the NORMAL engine, the
disaggregated pair (through real KV payload bytes) and runs that preempt and
recompute (S31), for both built-in variants."""

import pytest

from pdserve import LLM, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    return mixed_prompts


@pytest.fixture(scope="module")
def reference(model_dirs, hf_greedy, prompts):
    return {variant: hf_greedy(path, prompts, MAX_TOKENS) for variant, path in model_dirs.items()}


def run(llm: LLM, prompts):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    llm.assert_drained()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
@pytest.mark.parametrize("budget", [None, 5, 13, 50])
def test_normal_engine_equals_transformers(model_dirs, reference, prompts, variant, budget):
    llm = LLM(model_dirs[variant], block_size=4, max_num_seqs=4, max_num_batched_tokens=budget)
    assert run(llm, prompts) == reference[variant]


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
def test_disaggregated_equals_transformers(model_dirs, reference, prompts, variant):
    llm = LLM(model_dirs[variant], mode="disaggregated", block_size=4, max_num_seqs=8,
              max_num_batched_tokens=24)
    assert run(llm, prompts) == reference[variant]


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
def test_s31_preempted_and_recomputed_runs_equal_transformers(model_dirs, reference, prompts, variant):
    # 100-token prompt + 12 outputs needs 28 blocks of 4; 40 usable blocks force preemption.
    llm = LLM(model_dirs[variant], block_size=4, num_kv_blocks=41, max_num_seqs=8,
              max_num_batched_tokens=32)
    assert run(llm, prompts) == reference[variant]
    assert llm.engines[0].scheduler.num_preemptions > 0


def test_time_budget_chunk_sizer_measures_real_steps_and_keeps_the_tokens(model_dirs, reference,
                                                                           prompts):
    """Opt-in chunk sizer (spec section 9) on the real engine: it is fed every measured
    prompt step and fits a model, and the greedy tokens stay transformers'. (Its answers
    depend on this machine's timings: with steps this small, noise can leave no
    coefficient that grows with q, and then the token budget applies; the sizing itself
    is tested on a synthetic clock in tests/scheduler/test_policies.py.)"""
    llm = LLM(model_dirs["llama"], max_num_batched_tokens=24, max_num_seqs=8,
              chunk_time_budget_s=0.004)
    engine = llm.engines[0]
    observed = []
    feed = engine.scheduler.chunk_sizer.observe
    engine.scheduler.chunk_sizer.observe = lambda rows, s: (observed.append(rows), feed(rows, s))
    assert run(llm, prompts) == reference["llama"]
    sizer = engine.scheduler.chunk_sizer
    assert len(observed) == len(sizer._samples) >= sizer.min_samples
    assert sum(q for rows in observed for q, _ in rows) == sum(map(len, prompts))
    assert sizer.coefficients is not None
    budget = sizer.budget(0)
    assert budget is None or budget >= 16
