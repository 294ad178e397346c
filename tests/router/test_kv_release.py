"""One release path with a deadline for every KV backend, and one result type with an
explicit failure kind (kv_transfer/base.py).

A release or discard tells the source rank to free a payload; a source that never
answers must cost the router at most ``release_timeout_s`` (logged and counted), on
every backend. The sources here are stand-ins for a rank actor whose ``release_kv`` /
``release_kv_many`` calls never answer, fail, or answer at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import pytest

from pdserve.kv_transfer import KVSecret, make_transport
from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD,
    RELEASE_TIMEOUT_S,
    DeliveryResult,
    FailureKind,
    RankEndpoint,
)
from pdserve.kv_transfer.ray.shared_memory import SharedPayload
from pdserve.rank import messages

DEADLINE_S = 0.2


@dataclass
class Ticket:
    key: str  # what the source holds the payload under (a HandoffTicket's attempt)
    locator: Any


class _Call:
    def __init__(self, behaviour: str, calls: list) -> None:
        self.behaviour, self.calls = behaviour, calls

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)

        async def reply() -> None:
            if self.behaviour == "silent":
                await asyncio.Event().wait()  # a peer that never answers
            if self.behaviour == "dead":
                raise RuntimeError("the actor died")

        return reply()


class FakeActor:
    def __init__(self, behaviour: str) -> None:
        self.calls: list = []
        self.release_kv = _Call(behaviour, self.calls)
        self.release_kv_many = _Call(behaviour, self.calls)


@dataclass
class FakeRank:
    actor: FakeActor


def _ticket(name: str, attempt: str) -> Ticket:
    if name == "grpc":
        return Ticket(attempt, ("127.0.0.1:1", attempt))
    if name == "ray":  # a staged segment is the source's to reuse: it must be told
        return Ticket(attempt, SharedPayload("node", 1, 3, 4, 5, 100))
    return Ticket(attempt, attempt)


def _transport(name: str):
    transport = make_transport(name, KVSecret.generate() if name == "grpc" else None)
    transport.release_timeout_s = DEADLINE_S
    return transport


REMOTE = ["grpc", "ray", "device"]


def test_one_release_deadline():
    for name in REMOTE + ["in_process"]:
        assert make_transport(name, KVSecret.generate()).release_timeout_s == RELEASE_TIMEOUT_S


@pytest.mark.parametrize("name", REMOTE)
def test_release_to_a_silent_source_ends_at_the_deadline(name, caplog):
    transport = _transport(name)
    src = FakeRank(FakeActor("silent"))
    tickets = [_ticket(name, f"r{i}.0") for i in range(3)]

    async def main() -> list[float]:
        took = []
        for call in (transport.release(tickets[0], src), transport.discard(tickets[1], src),
                     transport.release_many(tickets, src)):
            start = time.monotonic()
            await asyncio.wait_for(call, DEADLINE_S * 10)  # never waits past its own
            took.append(time.monotonic() - start)
        return took

    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.base"):
        took = asyncio.run(main())
    assert all(DEADLINE_S * 0.9 <= t < DEADLINE_S * 5 for t in took), took
    assert transport.num_release_timeouts == 3 and transport.num_release_errors == 0
    assert sum("got no answer within" in r.getMessage() for r in caplog.records) == 3
    # one call each; release_many is one call for all of its tickets
    assert src.actor.calls == [("r0.0",), ("r1.0",), (["r0.0", "r1.0", "r2.0"],)]


@pytest.mark.parametrize("name", REMOTE)
def test_release_to_a_dead_source_is_counted(name):
    transport = _transport(name)
    src = FakeRank(FakeActor("dead"))

    async def main() -> None:
        await transport.discard(_ticket(name, "r.0"), src)
        await transport.release_many([_ticket(name, "r.0"), _ticket(name, "s.0")], src)

    asyncio.run(main())
    assert transport.num_release_errors == 2 and transport.num_release_timeouts == 0


@pytest.mark.parametrize("name", REMOTE)
def test_release_to_a_live_source(name):
    transport = _transport(name)
    src = FakeRank(FakeActor("ok"))
    asyncio.run(transport.release(_ticket(name, "r.0"), src))
    assert src.actor.calls == [("r.0",)]
    assert transport.num_release_errors == transport.num_release_timeouts == 0


def test_ray_object_payloads_need_no_call():
    """An object-store payload goes with the router's last reference: nothing to tell."""
    transport = _transport("ray")
    src = FakeRank(FakeActor("silent"))
    asyncio.run(transport.release_many([Ticket("r.0", b"an object ref")], src))
    asyncio.run(transport.discard(Ticket("r.0", b"an object ref"), src))
    assert src.actor.calls == [] and transport.num_release_timeouts == 0


def test_in_process_release_frees_the_endpoint():
    transport = _transport("in_process")
    src = type("Src", (), {})()
    src.endpoint = RankEndpoint()
    for key in ("a.0", "b.0", "c.0"):
        src.endpoint.export(key, b"x")
    asyncio.run(transport.release(Ticket("a.0", "a.0"), src))
    asyncio.run(transport.release_many([Ticket("b.0", "b.0"), Ticket("c.0", "c.0")], src))
    assert len(src.endpoint) == 0


# -- one result type, an explicit failure kind ---------------------------------------


def test_import_result_is_the_delivery_result():
    assert messages.ImportResult is DeliveryResult
    assert messages.FailureKind is FailureKind


def test_failure_kind_is_explicit_and_plain():
    import json
    import pickle

    result = DeliveryResult(False, kind="capacity", error="full")  # a plain word (a reply)
    assert result.kind is FailureKind.CAPACITY and result.kind == "capacity"
    assert DeliveryResult(True).kind is FailureKind.NONE
    assert str(CACHE_MISS) == "cache_miss" and f"{PAYLOAD}" == "payload"
    assert {"capacity": 1}[CAPACITY] == 1
    assert json.dumps(CAPACITY) == '"capacity"'
    assert pickle.loads(pickle.dumps(result)) == result
    with pytest.raises(ValueError):
        DeliveryResult(False, kind="guessed")


def test_refused_import_kind_comes_from_the_exception_type():
    from pdserve.decode_worker.actor import refused_kind as _refused_kind
    from pdserve.engine.engine import CacheMissError, NoCapacityError
    from pdserve.engine.kv.payload import KVPayloadError

    class Capacityish(ValueError):  # a name is no longer read
        pass

    assert _refused_kind(NoCapacityError("x")) is FailureKind.CAPACITY
    assert _refused_kind(CacheMissError("x")) is FailureKind.CACHE_MISS
    assert _refused_kind(KVPayloadError("x")) is FailureKind.PAYLOAD
    assert _refused_kind(Capacityish("x")) is FailureKind.PAYLOAD
