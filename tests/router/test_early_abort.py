"""An Abort that overtakes its own Generate is not lost."""

from __future__ import annotations

import time

import pytest

from pdserve.router.client import Client
from pdserve.router.requests import RequestTracker


def test_tracker_remembers_early_aborts_for_a_while_and_within_a_bound(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    tracker = RequestTracker(max_queue_depth=8, early_abort_ttl_s=5.0, max_early_aborts=3)
    tracker.remember_early_abort("a")
    tracker.remember_early_abort("")  # an empty id names nothing
    assert tracker.take_early_abort("a") and not tracker.take_early_abort("a")  # taken once
    tracker.remember_early_abort("old")
    now[0] += 6.0  # past the TTL
    assert not tracker.take_early_abort("old")
    for rid in ("b", "c", "d", "e"):  # one more than the bound: the oldest goes
        tracker.remember_early_abort(rid)
    assert not tracker.take_early_abort("b")
    assert all(tracker.take_early_abort(r) for r in ("c", "d", "e"))
    assert not tracker.take_early_abort("")


def test_early_aborts_are_per_tenant_and_bounded_per_tenant():
    tracker = RequestTracker(max_queue_depth=8, max_early_aborts=3)
    tracker.remember_early_abort("x", tenant="alice")
    assert not tracker.take_early_abort("x", tenant="bob")  # bob's "x" is another label
    for i in range(10):  # bob floods: only his own oldest go
        tracker.remember_early_abort(f"b{i}", tenant="bob")
    assert tracker.take_early_abort("x", tenant="alice")
    assert [tracker.take_early_abort(f"b{i}", tenant="bob") for i in range(10)] == \
        [False] * 7 + [True] * 3


@pytest.fixture(scope="module")
def router(shared_router):
    return shared_router


def test_generate_after_its_abort_ends_at_once_with_abort(router):
    with Client(router.address, timeout=60) as client:
        assert client.abort("early-1") is False  # not here yet
        out = client.generate("the quick brown fox", request_id="early-1", max_tokens=500,
                              ignore_eos=True)
        assert out.finish_reason == "abort" and out.token_ids == []
        # The id is free again, and only that id was affected.
        again = client.generate("the quick brown fox", request_id="early-1", max_tokens=3)
        assert again.finish_reason == "length" and len(again.token_ids) == 3
    stats = router.wait_drained(30.0)
    for ranks in stats.values():
        for r in ranks:
            assert r["num_free_blocks"] == r["num_total_blocks"]
    assert len(router.service.tracker) == 0
