"""Logprobs (SamplingParams.logprobs): each generated token's log-probability and the
top-k alternatives equal log_softmax of transformers' logits (fp32, within 1e-4), for
greedy and seeded sampled requests, offline in normal and disaggregated mode (the first
token then comes from the PROMPT engine), on the C decode step where this machine runs
it and on the torch path; requests without logprobs get none and cost nothing extra."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.model_runner import ModelRunner, RunnerRow
from pdserve.scheduler.sampling_params import SamplingParams

ATOL = 1e-4
_HF: dict = {}


def hf_logprobs(model_dir: str, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' fp32 logits at each generated token's position:
    row i is the distribution token ``generated[i]`` was drawn from."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logits = _HF[model_dir](ids).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(generated)]


def check_against(ref: torch.Tensor, tokens: list[int], logprobs, k: int) -> None:
    """Every token's logprob and its top-k (ids most likely first) match ``ref``."""
    assert logprobs is not None and len(logprobs) == len(tokens)
    for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        row = ref[i]
        assert lp.logprob == pytest.approx(float(row[tok]), abs=ATOL), (i, tok)
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        if k == 0:
            continue
        # values in order of probability, each the reference's value of its id
        assert all(a >= b for a, b in zip(lp.top_logprobs, lp.top_logprobs[1:], strict=False)), i
        for tid, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            assert v == pytest.approx(float(row[tid]), abs=ATOL), (i, tid)
        want_vals, want_ids = row.topk(k)
        assert lp.top_logprobs == pytest.approx(want_vals.tolist(), abs=ATOL), i
        # the same ids as the reference's top-k, but for neighbours closer than the
        # tolerance (whose order fp32 rounding may swap)
        for j, (got, want) in enumerate(zip(lp.top_ids, want_ids.tolist(), strict=True)):
            if got != want:
                assert abs(float(row[got]) - float(row[want])) < ATOL, (i, j, got, want)
        assert len(set(lp.top_ids)) == k


PROMPTS = [[1, 327, 399, 81, 10, 90, 320], [1] + list(range(100, 140)), [1, 4000, 17]]


def _params():
    return [
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, top_k=40, top_p=0.9, seed=1234,
                       logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def llms(model_dirs):
    """Normal mode with the C decode step where it applies, normal mode on the torch
    path, and disaggregated mode (the first token from the PROMPT engine)."""
    d = model_dirs["llama"]
    return {"normal": LLM(d, mode="normal"),
            "normal-torch": LLM(d, mode="normal", decode_kernel=False),
            "disaggregated": LLM(d, mode="disaggregated")}


@pytest.mark.parametrize("which", ["normal", "normal-torch", "disaggregated"])
def test_logprobs_equal_transformers(llms, model_dirs, which):
    llm = llms[which]
    if which == "normal-torch":
        assert not llm.engines[0].runner.decode_kernel
    params = _params()
    # one more request in the batch that asks for nothing
    outs = llm.generate(prompt_token_ids=PROMPTS + [PROMPTS[0]],
                        sampling_params=params + [SamplingParams(max_tokens=8,
                                                                 temperature=0.0)],
                        use_tqdm=False)
    for prompt, sp, out in zip(PROMPTS, params, outs, strict=False):
        assert len(out.token_ids) == 8
        ref = hf_logprobs(model_dirs["llama"], prompt, out.token_ids)
        check_against(ref, out.token_ids, out.logprobs, sp.logprobs)
    assert outs[3].logprobs is None
    # the greedy tokens are the reference's argmax, whichever request asked for what
    assert outs[3].token_ids == outs[0].token_ids
    for lp, tok in zip(outs[0].logprobs, outs[0].token_ids, strict=True):
        assert lp.top_ids[0] == tok and lp.top_logprobs[0] == lp.logprob
    llm.assert_drained()


def test_which_decode_path_ran(llms):
    """Says (in -v output) which decode path the default engine took on this machine;
    the logprobs test above covers it and the torch path."""
    kernel = llms["normal"].engines[0].runner.decode_kernel
    print(f"C decode step active: {kernel}")
    assert not llms["normal-torch"].engines[0].runner.decode_kernel


def test_asking_for_logprobs_does_not_change_the_tokens(llms):
    """Sampled (seeded) and greedy draws are the same with or without logprobs."""
    llm = llms["normal"]
    params = _params()
    plain = [SamplingParams(**{**p.__dict__, "logprobs": None}) for p in params]
    a = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    b = llm.generate(prompt_token_ids=PROMPTS, sampling_params=plain, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.logprobs is None for o in b)


def test_only_rows_that_ask_pay(model_dirs, monkeypatch):
    """No log_softmax at all in a step where no row asked, and only the asking rows'
    logits go through it in a mixed step (prefill, then decode)."""
    runner = ModelRunner(model_dirs["llama"], block_size=16, num_kv_blocks=32)
    seen: list[tuple] = []
    real = torch.log_softmax

    def counting(x, *a, **kw):
        seen.append(tuple(x.shape))
        return real(x, *a, **kw)

    monkeypatch.setattr(torch, "log_softmax", counting)
    asks = SamplingParams(temperature=0.0, logprobs=2)
    rows = [RunnerRow([1, 5, 6], 0, [1], sampling=SamplingParams(temperature=0.0)),
            RunnerRow([1, 7, 8, 9], 0, [2], sampling=asks),
            RunnerRow([1, 10], 0, [3], sampling=SamplingParams(temperature=0.0))]
    tokens, lps = runner.execute_with_logprobs(rows)
    assert seen == [(1, runner.vocab_size)]
    assert lps[0] is None and lps[2] is None and lps[1].top_ids[0] == tokens[1]
    seen.clear()
    plain = [RunnerRow([tokens[0]], 3, [1], sampling=rows[0].sampling, output_index=1),
             RunnerRow([tokens[2]], 2, [3], sampling=rows[2].sampling, output_index=1)]
    t2, none = runner.execute_with_logprobs(plain)
    assert none is None and seen == []
    assert runner.execute(plain[:0]) == []
    # a non-final chunk samples nothing, so it has no logprobs even if it asked
    _, chunk = runner.execute_with_logprobs([RunnerRow([1, 2, 3], 0, [4], sampling=asks,
                                                       sample=False)])
    assert chunk is None and seen == []


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_sampling_params_refuse_bad_logprobs(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_sampling_params_accept_the_range():
    for k in (None, 0, 1, 20):
        assert SamplingParams(logprobs=k).logprobs == k
