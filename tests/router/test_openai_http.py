"""The OpenAI-compatible HTTP front, driven by the real `openai` package and `curl`."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

PROMPTS = ["def add(x, y):", "the quick brown fox"]


@pytest.fixture(scope="module")
def router(shared_router):
    return shared_router


@pytest.fixture(scope="module")
def base_url(router):
    return f"http://127.0.0.1:{router.server.http_port}/v1"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Path(tiny_model_dir).name


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_models_lists_the_served_model(client, model):
    ids = [m.id for m in client.models.list().data]
    assert ids == [model]


def test_greedy_completions_equal_grpc_and_offline(client, model, router, reference):
    from pdserve.router.client import Client

    want = reference(PROMPTS, 12)
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1]
    with Client(router.address, timeout=60) as g:
        texts = [g.generate(p, max_tokens=12, temperature=0).text for p in PROMPTS]
    for choice, ids, text in zip(out.choices, want, texts, strict=True):
        assert choice.model_extra["token_ids"] == ids
        assert choice.text == text and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens == sum(len(c.model_extra["prompt_token_ids"])
                                          for c in out.choices)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    # a prompt of token ids
    ids_prompt = out.choices[0].model_extra["prompt_token_ids"]
    again = client.completions.create(model=model, prompt=ids_prompt, max_tokens=12,
                                      temperature=0)
    assert again.choices[0].text == texts[0]


def test_streamed_completion_equals_the_whole_one_and_reports_usage(client, model):
    whole = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=10,
                                      temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_stop_string_over_http(client, model):
    whole = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                      temperature=0).choices[0].text
    stop = whole[5:9]
    assert len(stop) == 4
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                    temperature=0, stop=[stop]).choices[0]
    assert out.text == whole[: whole.find(stop)] and out.finish_reason == "stop"
    streamed = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_async_client(base_url, model):
    async def run():
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as c:
            outs = await asyncio.gather(*(c.completions.create(
                model=model, prompt=p, max_tokens=6, temperature=0) for p in PROMPTS))
            return [o.choices[0].text for o in outs]

    texts = asyncio.run(run())
    assert all(texts)


@pytest.mark.parametrize("kwargs, status, param", [
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"n": 0}, 400, "n"),
    ({"temperature": -1.0}, 400, "temperature"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"stop": [""]}, 400, "stop"),
    ({"extra_body": {"suffix": "x"}}, 400, "suffix"),
    ({"extra_body": {"best_of": 3}}, 400, "best_of"),
])
def test_bad_fields_are_openai_errors_naming_the_field(client, model, kwargs, status, param):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=model, prompt="hi", **kwargs)
    assert info.value.status_code == status
    err = info.value.body
    assert err["param"] == param and param in err["message"], err


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in info.value.body["message"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl(base_url, model):
    body = json.dumps({"model": model, "prompt": PROMPTS[0], "max_tokens": 5,
                       "temperature": 0})
    r = subprocess.run(["curl", "-sS", f"{base_url}/completions", "-H",
                        "Content-Type: application/json", "-d", body],
                       capture_output=True, text=True, timeout=60)
    out = json.loads(r.stdout)
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
    r = subprocess.run(["curl", "-sS", "-N", f"{base_url}/completions", "-H",
                        "Content-Type: application/json", "-d",
                        json.dumps({**json.loads(body), "stream": True})],
                       capture_output=True, text=True, timeout=60)
    events = [line[len("data: "):] for line in r.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == \
        out["choices"][0]["text"]
    r = subprocess.run(["curl", "-sS", "-w", "%{http_code}", f"{base_url}/completions", "-H",
                        "Content-Type: application/json", "-d", "{not json"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.endswith("400") and "not valid JSON" in r.stdout
    r = subprocess.run(["curl", "-sS", f"{base_url.rsplit('/v1', 1)[0]}/health"],
                       capture_output=True, text=True, timeout=30)
    assert r.stdout == "ok"


def test_tokens_are_needed_when_configured(make_router, tokens, model):
    router = make_router(mode="normal", normal=1, auth_token_file=tokens.tenant_file)
    try:
        url = f"http://127.0.0.1:{router.server.http_port}/v1"
        with openai.OpenAI(base_url=url, api_key="wrong-token-xxxxxxxx", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
            with pytest.raises(openai.AuthenticationError):
                c.completions.create(model=model, prompt="hi", max_tokens=2)
        with openai.OpenAI(base_url=url, api_key=tokens.alice, max_retries=0) as c:
            assert c.completions.create(model=model, prompt="hi", max_tokens=2,
                                        temperature=0).choices[0].text is not None
    finally:
        router.close()


def test_bench_serve_drives_the_openai_backend(base_url, tiny_model_dir, tmp_path):
    from pdserve.bench.serve import main as serve_main

    out = tmp_path / "openai.json"
    rc = serve_main(["--backend", "openai", "--base-url", base_url, "--model", tiny_model_dir,
                     "--num-prompts", "3", "--random-input-len", "16",
                     "--random-output-len", "5", "--disable-tqdm", "--no-plot",
                     "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 3 and r["output_lens"] == [5, 5, 5]
    assert r["mean_ttft_ms"] > 0 and r["mean_itl_ms"] > 0


def test_chat_streamed_equals_whole_and_reports_usage(client, model, router):
    messages = [{"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "def add(x, y):"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                           temperature=0, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 10 and choice.message.content
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # the template's text, tokenized once (one BOS), is what the completion endpoint sees
    from pdserve.router.chat_template import ChatTemplate

    tpl = ChatTemplate.from_model_dir(router.service.config.model_dir)
    ids = tpl.encode(router.service.tokenizer, tpl.render(messages, True))
    bos = router.service.tokenizer.bos_token_id
    assert ids[0] == bos and ids[1] != bos  # exactly one BOS
    same = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0)
    assert same.choices[0].text == choice.message.content
    assert whole.usage.prompt_tokens == len(ids)


def test_chat_errors_name_the_field(client, model):
    for kwargs, param in (({"messages": [{"role": "user"}]}, "messages"),
                          ({"messages": "hi"}, "messages"),
                          ({"messages": [{"role": "user", "content": "x"}],
                            "extra_body": {"tools": [{"type": "function"}]}}, "tools"),
                          ({"messages": [{"role": "user", "content": "x"}],
                            "extra_body": {"response_format": {
                                "type": "json_schema",
                                "json_schema": {"name": "a", "schema": {"type": "foo"}}}}},
                           "response_format")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, max_tokens=2, **kwargs)
        assert info.value.body["param"] == param, info.value.body


def test_logprobs_over_http_equal_grpcs(client, model, router):
    from pdserve.router.client import Client

    with Client(router.address, timeout=60) as g:
        want = g.generate(PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6,
                                    temperature=0, logprobs=3).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == 6 and len(lp.top_logprobs) == 6
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-6)
    tok = router.service.tokenizer
    for tops, ref in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert len(ref.top_token_ids) == 3
        assert set(tops) == {tok.decode([i], False) for i in ref.top_token_ids} or \
            len(set(tok.decode([i], False) for i in ref.top_token_ids)) < 3
    assert "".join(lp.tokens) == out.text and lp.text_offset[0] == 0
    messages = [{"role": "user", "content": "def add(x, y):"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
               for c in content)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           temperature=0)
    assert plain.choices[0].logprobs is None


def test_a_stream_the_client_drops_ends_on_its_ranks(base_url, model, router):
    import httpx2 as httpx

    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{base_url}/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    router.assert_nothing_left(timeout=20)  # aborted, its blocks free, nothing in flight


def test_a_full_queue_is_429_and_the_first_request_is_unharmed(make_router, model):
    import threading

    router = make_router(mode="normal", normal=1, max_queue_depth=1)
    try:
        url = f"http://127.0.0.1:{router.server.http_port}/v1"
        with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60) as c:
            first = {}
            started = threading.Event()

            def long_one():
                stream = c.completions.create(model=model, prompt="hello", max_tokens=200,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
                text = ""
                for chunk in stream:
                    started.set()
                    text += chunk.choices[0].text
                    first["finish"] = chunk.choices[0].finish_reason or first.get("finish")
                first["text"] = text

            t = threading.Thread(target=long_one)
            t.start()
            assert started.wait(30)
            with pytest.raises(openai.RateLimitError) as info:
                c.completions.create(model=model, prompt="hi", max_tokens=2)
            assert "max_queue_depth" in info.value.body["message"]
            t.join(60)
            assert first["finish"] == "length" and first["text"]
        router.assert_nothing_left()
    finally:
        router.close()
