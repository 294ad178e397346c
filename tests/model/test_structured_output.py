"""Structured output on the real model (SmolLM2-135M-Instruct), offline: every greedy and
sampled answer under a JSON schema parses and validates (the ``jsonschema`` library) in
normal and disaggregated modes, with n = 3 forks, after a move (the answer so far at the
end of the prompt) and after preemptions (recomputed, matchers kept); regex, choice and
EBNF guides; the penalties and bias reach the tokens; unguided rows are unchanged."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdserve import LLM, SamplingParams
from pdserve.scheduler.sampling_params import Guide

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]},
            "pets": {"type": "array", "maxItems": 3,
                     "items": {"type": "object",
                               "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                              "age": {"type": "integer", "minimum": 0,
                                                      "maximum": 30}},
                               "required": ["kind"]}},
            "nickname": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "address", "pets"],
        "additionalProperties": False,
    },
    "bounded": {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                       "unit": {"enum": ["C", "F"]},
                       "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
                       "rainy": {"type": "boolean"}},
        "required": ["temperature", "unit", "city"],
        "additionalProperties": False,
    },
    "list": {"type": "array", "minItems": 1, "maxItems": 4,
             "items": {"type": "string", "maxLength": 16}},
}
PROMPTS = {
    "nested": "Describe a person who lives in a city and has pets, as JSON.",
    "bounded": "Give today's weather in a city as JSON.",
    "list": "List three fruits as a JSON array.",
}
MAX_TOKENS = 160


def _chat(llm, text: str) -> list[int]:
    from pdserve.router.chat_template import ChatTemplate

    template = ChatTemplate.from_model_dir(llm.engines[0].runner.model_dir)
    return list(template.encode(llm.tokenizer,
                                template.render([{"role": "user", "content": text}])))


def _params(name: str, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, guide=Guide("json", json.dumps(SCHEMAS[name])),
                          **kw)


def _validate(name: str, out) -> None:
    assert out.finish_reason == "stop", (name, out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), SCHEMAS[name])


@pytest.fixture(scope="module", params=["normal", "disaggregated"])
def llm(request, real_model_path):
    # fp32 activations: a moved request's replay (a prompt) continues a decode step's
    # tokens bit for bit only on exact rows (docs/models.md, activation precision)
    return LLM(real_model_path, mode=request.param, max_num_seqs=16, activation_precision="fp32")


def test_every_answer_validates_greedy_and_sampled(llm):
    names = [n for n in SCHEMAS for _ in range(4)]
    params = [_params(n, temperature=0.0) if i % 4 == 0 else
              _params(n, temperature=0.9, seed=100 + i)
              for i, n in enumerate(names)]
    outs = llm.generate(prompt_token_ids=[_chat(llm, PROMPTS[n]) for n in names],
                        sampling_params=params, use_tqdm=False)
    for name, out in zip(names, outs, strict=True):
        _validate(name, out)
    llm.assert_drained()


def test_n3_forks_each_validate(llm):
    """n = 3: the forks share the prompt (one prefill, one hand-off in disaggregated
    mode) and each gets a matcher of its own."""
    first = llm.engines[0]
    sp = _params("bounded", temperature=1.0, seed=7)
    first.add_request("f0", _chat(llm, PROMPTS["bounded"]), sp,
                      forks=[("f1", sp.for_choice(1)), ("f2", sp.for_choice(2))])
    texts: dict[str, list[int]] = {"f0": [], "f1": [], "f2": []}
    finished: dict[str, str] = {}
    while len(finished) < 3:
        for out in llm._step():
            texts[out.attempt] += out.new_token_ids
            if out.finished:
                finished[out.attempt] = out.finish_reason
    assert set(finished.values()) == {"stop"}
    answers = [json.loads(llm.tokenizer.decode(ids)) for ids in texts.values()]
    for answer in answers:
        jsonschema.validate(answer, SCHEMAS["bounded"])
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 1  # seeds differ
    llm.assert_drained()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_moved_request_continues_token_for_token(llm, temperature):
    """A move starts the request again from its history, the answer so far at the end
    of the prompt (prior_output_tokens): its matcher is replayed, its penalties count
    the same answer, its seeded draws keep their positions, so it goes on with the very
    tokens it would have drawn."""
    prompt = _chat(llm, PROMPTS["nested"])
    sp = _params("nested", temperature=temperature, seed=11, frequency_penalty=0.3,
                 repetition_penalty=1.1)
    [whole] = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
    _validate("nested", whole)
    answer = whole.token_ids  # the generated tokens
    for k in (1, 9, len(answer) // 2):
        moved = replace(sp, max_tokens=sp.max_tokens - k, prior_output_tokens=k)
        [rest] = llm.generate(prompt_token_ids=[prompt + answer[:k]], sampling_params=moved,
                              use_tqdm=False)
        assert rest.token_ids == answer[k:], k
    llm.assert_drained()


def test_a_moved_answer_that_does_not_fit_its_grammar_ends_once(llm):
    """A history whose answer so far breaks the grammar (no matcher can replay it) ends
    with structured_output_failed, once, and leaves nothing behind."""
    prompt = _chat(llm, PROMPTS["nested"])
    broken = llm.tokenizer.encode("not json at all")
    sp = replace(_params("nested", temperature=0.0), prior_output_tokens=len(broken))
    [out] = llm.generate(prompt_token_ids=[prompt + broken], sampling_params=sp,
                         use_tqdm=False)
    assert out.finish_reason == "structured_output_failed"
    assert len(out.token_ids) <= 1
    llm.assert_drained()


def test_regex_choice_and_grammar_guides(llm):
    prompt = _chat(llm, "Answer with a code.")
    guides = [Guide("regex", r"[A-Z]{3}-[0-9]{4}"), Guide("choice", json.dumps(["yes", "no"])),
              Guide("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?')]
    outs = llm.generate(prompt_token_ids=[prompt] * 3, use_tqdm=False, sampling_params=[
        SamplingParams(max_tokens=30, temperature=0.7, seed=3, guide=g) for g in guides])
    import re

    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", outs[0].text), outs[0].text
    assert outs[1].text in ("yes", "no")
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", outs[2].text), outs[2].text
    assert all(o.finish_reason == "stop" for o in outs)


def test_penalties_and_bias_change_the_answer_and_unguided_rows_do_not(llm):
    prompt = _chat(llm, "Repeat the word cat ten times.")
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cat = sorted(set(llm.tokenizer.encode(" cat", add_special_tokens=False)
                     + llm.tokenizer.encode("cat", add_special_tokens=False)))
    base, again, penalized, banned = llm.generate(
        prompt_token_ids=[prompt] * 4, use_tqdm=False, sampling_params=[
            plain, plain, replace(plain, presence_penalty=2.0, frequency_penalty=2.0),
            replace(plain, bad_words_token_ids=[[t] for t in cat])])
    assert base.token_ids == again.token_ids
    answer = base.token_ids
    assert len(set(answer)) < len(answer)  # the plain answer repeats itself
    assert set(cat) & set(answer)  # and says cat
    new = penalized.token_ids
    # each repeat costs 2 + 2k: a token drawn again is rarer than in the plain answer
    assert len(new) - len(set(new)) < len(answer) - len(set(answer))
    assert not set(cat) & set(banned.token_ids)


def test_preempted_guided_requests_are_recomputed_and_still_validate(real_model_path):
    """Too few KV blocks for all of them: some are preempted (the offline LLM
    recomputes, section 9's policy on) and each still validates."""
    llm = LLM(real_model_path, max_num_seqs=8, num_kv_blocks=40)
    prompt = _chat(llm, PROMPTS["nested"])
    params = [_params("nested", temperature=0.9, seed=i) for i in range(8)]
    outs = llm.generate(prompt_token_ids=[prompt] * 8, sampling_params=params,
                        use_tqdm=False)
    assert llm.engines[0].scheduler.num_preemptions > 0
    for out in outs:
        _validate("nested", out)
    llm.assert_drained()
