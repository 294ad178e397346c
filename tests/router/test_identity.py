"""Request identity: the router's internal ids and attempts, client ids as labels.

The failures these tests pin down were seen against a live router: reusing a
request_id right after cancelling its stream, and a client that picks the id the router
would generate next, broke other requests (wrong tokens, `already in flight`, an Abort
that ended someone else's request)."""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.rank.messages import AttemptKey
from pdserve.router.client import Client, build_request
from pdserve.router.requests import RequestTracker
from pdserve.router.validation import PreparedRequest
from pdserve.scheduler.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def router(shared_router):
    return shared_router


def _prepared(label: str = "") -> PreparedRequest:
    return PreparedRequest(label, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))


def test_internal_ids_are_random_and_attempts_are_keys():
    tracker = RequestTracker(max_queue_depth=64)
    states = [tracker.register(_prepared()) for _ in range(32)]
    rids = [s.rid for s in states]
    assert len(set(rids)) == 32 and all(len(r) == 24 for r in rids)  # 96 random bits
    assert len({r[:8] for r in rids}) > 16  # no shared counter-like prefix
    s = states[0]
    first = s.begin_attempt().attempt
    assert isinstance(first, AttemptKey) and (first.request, first.number) == (s.rid, 1)
    assert AttemptKey.parse(first) == f"{s.rid}.1" and AttemptKey.parse("x.y") is None
    s.stage = "prefill"
    assert tracker.by_attempt(first) is s
    s.stage = "queued"  # moving: its next attempt is not dispatched yet
    assert tracker.by_attempt(first) is None
    second = s.begin_attempt().attempt
    s.stage = "decode"
    assert tracker.by_attempt(second) is s
    assert tracker.by_attempt(first) is None  # a stale attempt's reports are dropped
    assert tracker.by_attempt("garbage") is None and tracker.by_attempt(f"{s.rid}.x") is None


def test_a_label_is_free_the_moment_its_request_ended_for_the_client():
    tracker = RequestTracker(max_queue_depth=8)
    a = tracker.register(_prepared("mine"))
    with pytest.raises(Exception, match="already in flight"):
        tracker.register(_prepared("mine"))
    a.finish("abort", "cancelled")  # the engines may still be cleaning up its attempt
    b = tracker.register(_prepared("mine"))
    assert b.rid != a.rid and tracker.by_label("mine") is b
    tracker.release(a.rid)  # the old stream closing later does not touch the new one
    assert tracker.by_label("mine") is b


def test_a_moved_attempt_recomputes_the_history_and_generates_only_the_rest():
    tracker = RequestTracker(max_queue_depth=8)
    s = tracker.register(PreparedRequest("", [5, 6, 7], SamplingParams(
        max_tokens=10, temperature=0.7, seed=3)))
    s.begin_attempt()
    s.push([11, 12, 13])
    add = s.begin_attempt()
    assert add.prompt_token_ids == [5, 6, 7, 11, 12, 13]
    assert add.sampling.max_tokens == 7 and add.sampling.seed == 3
    assert not s.accept([14], 2)  # a gap: the report with token 1 of this attempt is lost
    assert s.accept([14], 1) and s.accept([15, 16], 3)


def test_reusing_a_label_right_after_cancelling_its_stream(router, reference):
    """20 rounds: start a long stream under one label, cancel it after two messages,
    start a new request under the same label at once: it gets its own tokens only."""
    prompt = "reuse: the quick brown fox"
    want = reference([prompt], 24)[0]
    retries = 0
    with Client(router.address, timeout=60) as client:
        for _ in range(20):
            call = client._stub.Generate(build_request(
                "a long one", request_id="reuse", max_tokens=1500, temperature=0,
                ignore_eos=True), timeout=60)
            next(call)
            next(call)
            call.cancel()
            for _attempt in range(100):  # free once the router has seen the cancel
                try:
                    out = client.generate(prompt, request_id="reuse", max_tokens=24,
                                          temperature=0)
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.ALREADY_EXISTS, exc
                    retries += 1
                    time.sleep(0.01)
            assert out.finish_reason == "length", out.error
            assert out.token_ids == want and out.request_id == "reuse"
    assert retries < 40
    router.assert_nothing_left()


def test_a_client_cannot_reach_another_clients_request_by_guessing_its_id(router, reference):
    prompt = "guess: once upon a time"
    want = reference([prompt], 300)[0]
    with Client(router.address, timeout=60) as a, Client(router.address, timeout=60) as b:
        call = a._stub.Generate(build_request(prompt, max_tokens=300, temperature=0,
                                              ignore_eos=True), timeout=60)
        first = next(call)
        generated = first.request_id
        assert len(generated) == 24  # the router's id, echoed (random, not a counter)
        # using the id it saw as its own label is refused, and harms nothing (asked at
        # once: the request is surely still in flight)
        with pytest.raises(grpc.RpcError) as err:
            b.generate(prompt, request_id=generated, max_tokens=2)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        # guesses at "the next id" reach nothing
        for guess in ("req-0", "req-1", generated[:-1] + "0", "0" * 24):
            if guess != generated:
                assert b.generate(prompt, request_id=guess, max_tokens=2,
                                  temperature=0).finish_reason == "length"
                assert b.abort(guess) is False  # nothing in flight under that label
        tokens = list(first.token_ids)
        for msg in call:
            tokens += msg.token_ids
            last = msg
        assert last.finish_reason == "length" and tokens == want
    router.assert_nothing_left()
