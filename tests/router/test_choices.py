"""n > 1 through the router: the choices of one prompt share one prefill (and, in
disaggregated mode, one KV hand-off), over gRPC and the OpenAI HTTP front.

Choice i samples with seed + i, so each choice equals a request of its own with that
seed; greedy choices all equal the offline LLM's output. Every choice ends once
(abort by label ends them all; a stop string ends each where it matches) and every
block is free afterwards."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from pdserve.router.client import Client

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module", params=["disaggregated", "normal"])
def router(request, shared_router, make_router):
    if request.param == "disaggregated":
        yield shared_router
        return
    harness = make_router(mode="normal")
    yield harness
    harness.close()


def steps_since(router, t0: float, kind: str) -> list[dict]:
    return [r for r in router.call(router.service.timeline(t0))
            if r["kind"] == kind and r["num_rows"] > 0]


def test_n_greedy_choices_share_one_prefill_and_one_hand_off(router, reference):
    want = reference([PROMPT], 10)[0]
    t0 = time.time()
    with Client(router.address, timeout=60) as client:
        outs = client.generate_choices(PROMPT, 4, max_tokens=10, temperature=0)
    assert [o.token_ids for o in outs] == [want] * 4
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert all(o.completion_tokens == 10 for o in outs)
    time.sleep(0.3)  # the ranks' last step records
    prompt_pool = "prefill" if router.service.disaggregated else "normal"
    prompts = [r for r in steps_since(router, t0, "prompt") if r["pool"] == prompt_pool]
    assert len(prompts) == 1 and prompts[0]["num_rows"] == 1  # one prompt, one row
    if router.service.disaggregated:
        assert prompts[0]["num_handoffs"] == 1
        assert len(steps_since(router, t0, "import")) == 1  # one payload for four choices
    router.assert_nothing_left()


def test_seeded_choice_i_equals_a_request_with_seed_plus_i(router):
    settings = dict(max_tokens=12, temperature=1.0, top_k=50, ignore_eos=True)
    with Client(router.address, timeout=60) as client:
        outs = client.generate_choices(PROMPT, 3, seed=11, **settings)
        alone = [client.generate(PROMPT, seed=11 + i, **settings) for i in range(3)]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in outs}) == 3  # the choices differ
    router.assert_nothing_left()


def test_abort_by_label_ends_every_choice(router):
    results = []

    def run():
        with Client(router.address, timeout=60) as client:
            results.extend(client.generate_choices(
                PROMPT, 3, request_id="many", max_tokens=400, temperature=0, ignore_eos=True))

    thread = threading.Thread(target=run)
    thread.start()
    with Client(router.address, timeout=10) as client:
        deadline = time.monotonic() + 30
        while router.service.tracker.by_label("many") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # let them decode a little
        assert client.abort("many")
    thread.join(60)
    assert [o.finish_reason for o in results] == ["abort"] * 3
    router.assert_nothing_left()


def test_a_stop_string_at_the_first_token_ends_each_choice(router, reference):
    """The first token already matches: each choice ends while its hand-off may still
    be in flight, and nothing is left anywhere."""
    with Client(router.address, timeout=60) as client:
        first_text = client.generate(PROMPT, max_tokens=1, temperature=0).text
        assert first_text.strip()
        outs = client.generate_choices(PROMPT, 3, max_tokens=10, temperature=0,
                                       stop=[first_text.strip()])
    assert [o.finish_reason for o in outs] == ["stop"] * 3
    assert len({o.text for o in outs}) == 1
    router.assert_nothing_left()


def test_n_above_max_choices_is_refused_naming_n(router):
    limit = router.service.config.max_choices
    with Client(router.address, timeout=10) as client, pytest.raises(grpc.RpcError) as err:
        client.generate_choices(PROMPT, limit + 1, max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("n must be in [1, ")
    with Client(router.address, timeout=10) as client, pytest.raises(ValueError, match="choices"):
        client.generate(PROMPT, n=2)


# -- the OpenAI front ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_client(router):
    openai = pytest.importorskip("openai")
    url = f"http://127.0.0.1:{router.server.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Path(tiny_model_dir).name


def test_http_completions_n_per_prompt(openai_client, model, reference, router):
    prompts = [PROMPT, "def add(x, y):"]
    want = reference(prompts, 8)
    out = openai_client.completions.create(model=model, prompt=prompts, n=3, max_tokens=8,
                                           temperature=0, extra_body={"return_token_ids": True})
    # OpenAI's order: prompt 0's choices, then prompt 1's
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.model_extra["token_ids"] for c in out.choices] == [want[0]] * 3 + [want[1]] * 3
    prompt_tokens = sum(len(out.choices[i].model_extra["prompt_token_ids"]) for i in (0, 3))
    assert out.usage.prompt_tokens == prompt_tokens  # each prompt counted once
    assert out.usage.completion_tokens == 6 * 8
    router.assert_nothing_left()


def test_http_streamed_chat_n_equals_the_whole_one(openai_client, model, router):
    messages = [{"role": "user", "content": "name a colour"}]
    settings = dict(model=model, messages=messages, n=2, max_tokens=8, temperature=1.0,
                    seed=5)
    whole = openai_client.chat.completions.create(**settings)
    chunks = list(openai_client.chat.completions.create(
        **settings, stream=True, stream_options={"include_usage": True}))
    texts = ["", ""]
    finish = [None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert [c.index for c in whole.choices] == [0, 1]
    assert texts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    router.assert_nothing_left()


def test_http_n_too_large_is_a_400_naming_n(openai_client, model, router):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                         n=router.service.config.max_choices + 1)
    assert err.value.body["param"] == "n"
