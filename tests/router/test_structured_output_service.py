"""Structured output through the service, on the real model served disaggregated: the
`openai` client's ``response_format`` (json_schema, json_object), streamed and not, with
n = 3; gRPC's ``structured_output``; the penalties over both APIs give the same tokens;
and a decode rank killed mid-answer: the moved requests replay their matchers on the
new rank and every answer still validates."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "maxItems": 3,
                      "items": {"enum": ["en", "fr", "de", "es"]}},
        "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "zip": {"type": "string",
                                                          "pattern": "^[0-9]{5}$"}},
                 "required": ["name"]},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def _client(router):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=120)


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


def test_openai_response_format_json_schema_n3(real_router):
    with _client(real_router) as c:
        out = c.chat.completions.create(model=MODEL, messages=ASK, n=3, temperature=0.9,
                                        seed=5, max_tokens=160,
                                        response_format=_json_schema_format(PERSON))
        greedy = c.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                           max_tokens=160,
                                           response_format=_json_schema_format(PERSON))
    answers = [choice.message.content for choice in [*out.choices, *greedy.choices]]
    assert len(answers) == 4
    for choice in [*out.choices, *greedy.choices]:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len(set(answers[:3])) > 1  # the three choices sample differently


def test_openai_streamed_json_object(real_router):
    with _client(real_router) as c:
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Give a fruit as JSON."}],
            temperature=0.7, seed=1, max_tokens=120, stream=True,
            response_format={"type": "json_object"})
        chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert isinstance(json.loads(text), dict)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


def test_a_bad_schema_is_a_400_naming_the_field(real_router):
    with _client(real_router) as c, pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                  response_format=_json_schema_format({"type": "nonsense"}))
    assert "response_format" in str(err.value)


def test_penalties_give_the_same_tokens_over_grpc_and_http(real_router):
    from pdserve.router.client import Client

    prompt = "List the days of the week, then list them again."
    settings = dict(max_tokens=40, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                    repetition_penalty=1.2, logit_bias={11: -5.0}, min_tokens=30)
    with Client(real_router.address, timeout=120) as grpc_client:
        via_grpc = grpc_client.generate(prompt, **settings)
        plain = grpc_client.generate(prompt, max_tokens=40, temperature=0)
    with _client(real_router) as c:
        via_http = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
            presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"11": -5},
            extra_body=dict(repetition_penalty=1.2, min_tokens=30, return_token_ids=True))
    assert via_grpc.token_ids != plain.token_ids  # the settings reached the ranks
    assert len(via_grpc.token_ids) >= 30  # min_tokens held EOS back
    assert via_http.choices[0].text == via_grpc.text


def test_decode_rank_killed_mid_answer_moved_requests_still_validate(real_router):
    """Kill the decode rank while guided answers stream: each moves (re-prefilled from
    its history, the answer so far at the end of its prompt), its matcher is replayed
    on the new rank, and every answer validates. Runs last: the pool heals."""
    import ray

    from pdserve.router.client import AsyncClient

    pool = real_router.service.pools["decode"]
    n = 6

    async def run():
        async with AsyncClient(real_router.address, timeout=180) as client:
            async def one(i):
                return await client.generate(
                    ASK, max_tokens=160, temperature=0.8 if i % 2 else 0.0, seed=i,
                    structured_output={"json_schema": PERSON})

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            victim = None
            for _ in range(3000):  # a decode rank with answers under way
                victim = next((r for r in pool.ready() if r.inflight), None)
                if victim is not None and len(victim.inflight) >= 2:
                    break
                await asyncio.sleep(0.01)
            assert victim is not None, "no decode rank ever held a request"
            await asyncio.sleep(0.3)  # some tokens streamed before the kill
            ray.kill(victim.actor, no_restart=True)
            return await asyncio.gather(*tasks, return_exceptions=True)

    moves = real_router.service.num_moves
    started = time.monotonic()
    outs = asyncio.run(run())
    assert time.monotonic() - started < 180
    for out in outs:
        assert not isinstance(out, BaseException), out
        assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
        jsonschema.validate(json.loads(out.text), PERSON)
    assert real_router.service.num_moves > moves  # answers did move mid-way
    real_router.assert_nothing_left(timeout=60)


# the schema of the strict-schema issue: the grammar does not enforce its uniqueItems
LANGS = json.loads((Path(__file__).parent.parent / "data" / "unique_langs_schema.json")
                   .read_text())


def test_a_strict_schema_the_grammar_cannot_keep_is_refused_naming_keyword_and_path(
        real_router):
    """Refused before any rank sees it, over HTTP (strict: true) and gRPC (a gRPC schema
    is strict unless ``loose``), never answered with text that breaks it."""
    import grpc

    from pdserve.router.client import Client

    where = "uniqueItems at $.properties.person.properties.langs"
    with _client(real_router) as c, pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                  response_format=_json_schema_format(LANGS))
    assert where in str(err.value) and "response_format" in str(err.value)
    with Client(real_router.address, timeout=60) as grpc_client:
        with pytest.raises(grpc.RpcError) as failed:
            grpc_client.generate("hi", max_tokens=8, structured_output={"json_schema": LANGS})
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert where in failed.value.details()


def test_a_loose_schema_is_answered_with_the_advisory_named_in_a_header(real_router):
    loose = {"type": "json_schema", "json_schema": {"name": "p", "schema": LANGS}}
    with _client(real_router) as c:
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=12, temperature=0, response_format=loose)
        streamed = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=4, temperature=0, response_format=loose,
            stream=True)
    for response in (raw, streamed):
        assert response.headers["x-pdserve-schema-advisory"] == (
            "uniqueItems at $.properties.person.properties.langs")
    assert raw.parse().choices[0].message.content.startswith('{"person": {"name": "')
    strict_ok = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    with _client(real_router) as c:
        plain = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=4, response_format=strict_ok)
    assert "x-pdserve-schema-advisory" not in plain.headers
    from pdserve.router.client import Client

    with Client(real_router.address, timeout=60) as grpc_client:  # gRPC's loose
        out = grpc_client.generate("hi", max_tokens=4, temperature=0,
                                   structured_output={"json_schema": LANGS, "loose": True})
    assert out.text.startswith("{") and out.finish_reason == "length"
