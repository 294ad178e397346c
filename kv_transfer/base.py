"""The one interface every KV transport implements, with all its sides.

A transport moves a prefilled attempt's KV payload from a PROMPT rank to a
COMPLETION rank. Each backend is one module holding every side of it:

1. Export (on the prefill rank): ``RankEndpoint.export(attempt, payload)`` keeps the
   payload where the transport can reach it and returns a picklable *locator*, which
   travels to the router inside a ``HandoffTicket``.
2. Deliver (in the router): ``KVTransport.deliver(ticket, src, dst)`` makes the decode
   rank ``dst`` import the payload; its ``DeliveryResult`` says whether the decode rank
   confirmed the import, or why not (``payload``: refused, never retry; ``capacity``:
   try another rank; ``transport``: the bytes did not arrive, retry or re-prefill).
3. Receive (on the decode rank): the payload reaches ``EngineRank.import_prefilled``
   (as a resolved Ray argument, or pushed over gRPC chunks, ...).
4. Release / discard (router -> prefill rank): the payload is released only after the
   decode rank confirmed its import (``release``), or when its request ended on the way
   (``discard``). An endpoint also forgets payloads nobody asked for within
   ``max_age_s``, so a router that vanished cannot leak them.

``KVSecret`` is the per-cluster key of transports that authenticate their traffic
(``grpc``): the router makes one at start and hands it to its ranks through Ray only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

PAYLOAD, CAPACITY, TRANSPORT = "payload", "capacity", "transport"
# the payload left out a prefix the receiver's cache no longer holds: send it whole
CACHE_MISS = "cache_miss"
# Seconds an exported payload (or an import answer) nobody asked for is kept before it is
# forgotten (every endpoint, staging area and channel): a vanished router leaks nothing.
PAYLOAD_MAX_AGE_S = 600.0


@dataclass
class DeliveryResult:
    ok: bool
    attempt: str = ""
    kind: str = ""  # on failure: PAYLOAD | CAPACITY | TRANSPORT
    error: str = ""
    nbytes: int = 0


class KVSecret:
    """The cluster's key for authorizing KV transfers (HMAC-SHA256); its repr hides it.

    Made by the router (``KVSecret.generate()``: ``secrets.token_bytes(32)``) and sent
    to every rank as a Ray actor argument, never through the environment, a file or a
    log. ``authorize`` gives the MAC of one operation on one attempt at one rank's KV
    address, valid until ``expires`` (unix seconds); ``verify`` checks one in constant
    time.
    """

    __slots__ = ("_key",)
    SIZE = 32

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("a KV secret must be at least 16 random bytes")
        self._key = key

    @classmethod
    def generate(cls) -> KVSecret:
        return cls(secrets.token_bytes(cls.SIZE))

    @staticmethod
    def message(operation: str, attempt: str, address: str, expires: int) -> bytes:
        """What the MAC covers: every field length-prefixed, so none can run into the next."""
        out = [b"pdserve-kv-auth/1"]
        for part in (operation, attempt, address, str(int(expires))):
            raw = part.encode("utf-8", "surrogateescape")
            out.append(len(raw).to_bytes(4, "big") + raw)
        return b"".join(out)

    def authorize(self, operation: str, attempt: str, address: str, expires: int) -> str:
        return hmac.new(self._key, self.message(operation, attempt, address, expires),
                        hashlib.sha256).hexdigest()

    def verify(self, operation: str, attempt: str, address: str, expires: int,
               mac: str) -> bool:
        expected = self.authorize(operation, attempt, address, expires).encode()
        return hmac.compare_digest(expected, mac.encode("utf-8", "replace"))

    def __reduce__(self):  # pickled (by Ray) whole; only its repr is hidden
        return (KVSecret, (self._key,))

    def __repr__(self) -> str:
        return "KVSecret(<hidden>)"

    __str__ = __repr__


def payload_without_prefix(data: Any, num_blocks: int) -> bytes:
    """A KV payload's bytes without its first ``num_blocks`` full blocks (the rank side
    of ``deliver(..., skip_blocks)``; imports torch). One that cannot leave a prefix out
    (a sliding-window ring) goes whole: the receiver then finds no blocks skipped."""
    from pdserve.engine.kv_payload import KVPayload, KVPayloadError

    try:
        return KVPayload.from_bytes(data).without_prefix(num_blocks).to_bytes()
    except KVPayloadError:
        return data


class KVTransport(ABC):
    """The router's side: deliver, release, discard."""

    name: str = ""
    # whether a prefill rank can ask the decode rank for the import itself (ray only;
    # see router/kv_stream.py): then ``direct_result`` reads what it answered
    direct_handoff: bool = False

    def direct_result(self, result: Any, nbytes: int) -> DeliveryResult:
        raise NotImplementedError(f"the {self.name} transport hands nothing off directly")

    def expect_direct(self, src: Any, dst: Any) -> tuple[str, str]:
        """Where and under which id ``dst`` may answer a direct hand-off from ``src`` to
        the router itself (ray, one node); ("", ""): through the prefill rank's call."""
        return "", ""

    async def direct_answer(self, reply: Any, dst: Any, nbytes: int) -> DeliveryResult:
        raise NotImplementedError(f"the {self.name} transport takes no direct answers")

    def forget_direct(self, reply_id: str) -> None:
        return None

    def __init__(self) -> None:
        self.bytes_moved = 0
        self.num_deliveries = 0

    @abstractmethod
    async def deliver(self, ticket: Any, src: Any, dst: Any,
                      skip_blocks: int = 0) -> DeliveryResult:
        """Import the payload behind ``ticket`` (exported by rank ``src``) on ``dst``;
        ``skip_blocks``: leave out its first full blocks of KV, which ``dst``'s prefix
        cache holds (the source cuts them, so they never cross the wire; ``dst``
        answers CACHE_MISS if it no longer holds them)."""

    async def release(self, ticket: Any, src: Any) -> None:
        """The decode rank confirmed the import: the source may free the payload."""
        await self.discard(ticket, src)

    async def release_many(self, tickets: list[Any], src: Any) -> None:
        """``release`` of several payloads of one source (a request's streamed chunks);
        a transport whose release is a call to the source makes it one call."""
        await asyncio.gather(*(self.release(ticket, src) for ticket in tickets))

    @abstractmethod
    async def discard(self, ticket: Any, src: Any) -> None:
        """Free the payload behind ``ticket`` without importing it anywhere."""

    async def close(self) -> None:
        return None

    def _delivered(self, nbytes: int) -> None:
        self.bytes_moved += nbytes
        self.num_deliveries += 1


class RankEndpoint:
    """A rank's side: holds exported payloads until released (kept in this process)."""

    address: str | None = None  # where other processes reach this endpoint, if anywhere

    def __init__(self, max_age_s: float = PAYLOAD_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._payloads: dict[str, tuple[float, Any]] = {}
        # export/release run on the rank's threads, get on a server's (grpc)
        self._payloads_lock = threading.Lock()

    def payload_buffer(self, attempt: str, nbytes: int) -> Any:
        """A writable buffer of ``nbytes`` for the engine to write ``attempt``'s payload
        into (a transport with memory of its own to share lends that)."""
        return bytearray(nbytes)

    def forget_unexported(self) -> None:
        """Buffers lent for payloads whose export failed go back (after each step)."""
        return None

    def export(self, attempt: str, payload: Any) -> Any:
        with self._payloads_lock:
            self._expire()
            self._payloads[attempt] = (time.monotonic(), payload)
        return attempt

    def get(self, attempt: str) -> Any | None:
        with self._payloads_lock:
            entry = self._payloads.get(attempt)
        return None if entry is None else entry[1]

    def release(self, attempt: str) -> None:
        with self._payloads_lock:
            self._payloads.pop(attempt, None)

    def __len__(self) -> int:
        return len(self._payloads)

    def close(self) -> None:
        with self._payloads_lock:
            self._payloads.clear()

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.max_age_s
        for attempt in [a for a, (t, _) in self._payloads.items() if t < cutoff]:
            del self._payloads[attempt]
