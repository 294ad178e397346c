"""Speculative decoding (n-gram) on the real model, offline in both modes: greedy and
seeded outputs, logprobs included, are those of decoding without it, under a grammar
and penalties too, and after a move; copy-heavy prompts get drafts accepted."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdserve import LLM, SamplingParams
from pdserve.scheduler.sampling_params import Guide

PARAGRAPH = ("The quick brown fox jumps over the lazy dog. Packing boxes with five dozen "
             "liquor jugs is hard work, said the manager, who had been at the warehouse since "
             "early morning and wanted to go home before the rain started.")
CODE = "def f(a, b):\n    c = a + b\n    d = c * 2\n    return d\n"
ASKS = [f"Repeat this paragraph exactly:\n{PARAGRAPH}",
        f"Rewrite this code with better names:\n```python\n{CODE}```",
        "Write a short poem about autumn."]


def _prompts(llm) -> list[list[int]]:
    from pdserve.router.chat_template import ChatTemplate

    t = ChatTemplate.from_model_dir(llm.engines[0].runner.model_dir)
    return [t.encode(llm.tokenizer, t.render([{"role": "user", "content": a}])) for a in ASKS]


@pytest.fixture(scope="module", params=["normal", "disaggregated"])
def pair(request, real_model_path):
    # fp32 activations: int8 rounding would turn the rounding-level differences between a
    # step of one row and one of several into a quantization step (docs/models.md)
    kw = dict(mode=request.param, max_num_seqs=8, activation_precision="fp32")
    off = LLM(real_model_path, **kw)
    on = LLM(real_model_path, speculative="ngram", **kw)
    return off, on


def _run(llm, prompts, params):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    llm.assert_drained()
    return outs


def test_outputs_are_those_of_plain_decoding(pair):
    off, on = pair
    prompts = _prompts(off)
    for params in (SamplingParams(max_tokens=96, temperature=0.0, logprobs=2),
                   SamplingParams(max_tokens=96, temperature=0.8, seed=5, logprobs=1)):
        # one at a time (the batch of one a stream sees) and all together
        for batch in ([p] for p in prompts), [prompts]:
            for group in batch:
                want = _run(off, group, params)
                got = _run(on, group, params)
                for a, b in zip(want, got, strict=True):
                    assert b.token_ids == a.token_ids
                    assert [lp.logprob for lp in b.logprobs] == pytest.approx(
                        [lp.logprob for lp in a.logprobs], abs=1e-3)
                    assert [lp.top_ids for lp in b.logprobs] == \
                        [lp.top_ids for lp in a.logprobs]
                    assert b.finish_reason == a.finish_reason
    spec = on.engines[-1].speculator
    assert spec.metrics.num_accepted_tokens > 20  # the copy prompts did draft


def test_guided_and_penalized_answers_are_unchanged(pair):
    off, on = pair
    prompt = _prompts(off)[0]
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 200}},
              "required": ["text"]}
    params = [SamplingParams(max_tokens=120, temperature=0.0,
                             guide=Guide("json", json.dumps(schema))),
              SamplingParams(max_tokens=60, temperature=0.0, repetition_penalty=1.1,
                             frequency_penalty=0.2, stop_token_ids=[13])]
    want = _run(off, [prompt, prompt], params)
    got = _run(on, [prompt, prompt], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    json.loads(got[0].text)


def test_a_moved_request_continues_token_for_token(pair):
    _, on = pair
    prompt = _prompts(on)[1]
    sp = SamplingParams(max_tokens=80, temperature=0.7, seed=9)
    [whole] = _run(on, [prompt], sp)
    for k in (3, 17):
        moved = replace(sp, max_tokens=sp.max_tokens - k, prior_output_tokens=k)
        [rest] = _run(on, [prompt + whole.token_ids[:k]], moved)
        assert rest.token_ids == whole.token_ids[k:]
