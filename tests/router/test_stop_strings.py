"""Stop strings: matched on the detokenized text across token boundaries, the output cut
before the first match (or after it, when asked), finish reason "stop", and the request
ended on its rank at once."""

from __future__ import annotations

import grpc
import pytest

from pdserve.router.client import Client
from pdserve.router.text_output import TextOutput

PROMPT = "def add(x, y):"
N = 24


@pytest.fixture(scope="module")
def greedy(reference, tiny_model_dir):
    from pdserve.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_model(tiny_model_dir)
    ids = reference([PROMPT], N)[0]
    prompt_ids = tok.encode(PROMPT)
    full = tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)):]
    return tok, prompt_ids, ids, full


def _spanning_stop(tok, prompt_ids, ids, full):
    """A piece of the greedy text that starts inside one token and ends inside a later
    one (so no single token holds it)."""
    bounds, text = [], ""
    for i in range(len(ids)):
        text = tok.decode(prompt_ids + ids[: i + 1])[len(tok.decode(prompt_ids)):]
        bounds.append(len(text))
    for i in range(4, len(ids) - 3):
        a, b = bounds[i - 1], bounds[i + 1]  # token i+1 ends at bounds[i+1]
        if bounds[i] - a >= 2 and b - bounds[i] >= 2:
            stop = full[a + 1: b - 1]  # from inside token i to inside token i+1
            if full.find(stop) == a + 1:
                return stop
    pytest.skip("no greedy token pair to span")


def test_text_output_matches_across_tokens_however_tokens_arrive(greedy):
    tok, prompt_ids, ids, full = greedy
    stop = _spanning_stop(tok, prompt_ids, ids, full)
    want = full[: full.find(stop)]
    for step in (1, 2, 3, len(ids)):
        out = TextOutput(tok, prompt_ids, (stop, "never-in-this-text"))
        text, tokens, stopped = "", [], False
        for i in range(0, len(ids), step):
            delta = out.push(ids[i: i + step])
            text += delta.text
            tokens += delta.token_ids
            if delta.stopped:
                stopped = True
                break
        assert stopped and text == want, step
        # tokens reported: up to the one that completed the match
        assert tokens == ids[: len(tokens)]
        assert stop in tok.decode(prompt_ids + tokens)[len(tok.decode(prompt_ids)):]
        assert stop not in tok.decode(prompt_ids + tokens[:-1])[len(tok.decode(prompt_ids)):]
    out = TextOutput(tok, prompt_ids, (stop,), include_stop=True)
    assert out.push(ids).text == full[: full.find(stop) + len(stop)]
    out = TextOutput(tok, prompt_ids, ())
    assert out.push(ids).text + out.flush().text == full


def test_no_text_is_taken_back(greedy):
    tok, prompt_ids, ids, full = greedy
    out = TextOutput(tok, prompt_ids, ("zzzz-not-there",))
    streamed = ""
    for t in ids:
        delta = out.push([t])
        assert not delta.stopped
        streamed += delta.text
        assert full.startswith(streamed)
    assert streamed + out.flush().text == full


@pytest.fixture(scope="module")
def router(shared_router):
    return shared_router


def test_grpc_stop_string_spanning_tokens(router, greedy):
    tok, prompt_ids, ids, full = greedy
    stop = _spanning_stop(tok, prompt_ids, ids, full)
    with Client(router.address, timeout=60) as c:
        out = c.generate(PROMPT, max_tokens=N, temperature=0, stop=[stop])
        assert out.finish_reason == "stop" and out.error == ""
        assert out.text == full[: full.find(stop)]
        assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) < N
        assert out.completion_tokens == len(out.token_ids)
        out = c.generate(PROMPT, max_tokens=N, temperature=0, stop=[stop],
                         include_stop_str_in_output=True)
        assert out.text == full[: full.find(stop) + len(stop)]
        # a stop string that never occurs changes nothing
        out = c.generate(PROMPT, max_tokens=N, temperature=0, stop=["\x07never\x07"])
        assert out.finish_reason == "length" and out.token_ids == ids and out.text == full
    router.assert_nothing_left()  # the stopped requests' blocks are free


def test_grpc_stop_string_ends_a_long_request_on_its_rank(router, greedy):
    tok, prompt_ids, ids, full = greedy
    stop = _spanning_stop(tok, prompt_ids, ids, full)
    with Client(router.address, timeout=60) as c:
        out = c.generate(PROMPT, max_tokens=400, ignore_eos=True, temperature=0, stop=[stop])
    assert out.finish_reason == "stop" and len(out.token_ids) < N
    router.assert_nothing_left(timeout=10)  # ended at once, not after 400 tokens


def test_bad_stop_strings_name_the_field(router):
    with Client(router.address, timeout=30) as c:
        for stop, field in ((["ok", ""], "stop[1]"), (["x"] * 17, "stop"),
                            (["y" * 257], "stop[0]")):
            with pytest.raises(grpc.RpcError) as info:
                c.generate(PROMPT, max_tokens=2, stop=stop)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in info.value.details()
