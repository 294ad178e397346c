"""The one interface every KV transport implements, with all its sides.

A transport moves a prefilled attempt's KV payload from a PROMPT rank to a
COMPLETION rank. Each backend is one folder holding every side of it (``ray/``,
``grpc/``, ``device/``, ``in_process/``): the router's ``KVTransport``, the rank's
``RankEndpoint``, and the typed calls one makes of the other. A rank knows no backend:
it builds its endpoint with ``make_endpoint`` and passes every backend call it gets
(``EngineRank.kv_call``) to ``RankEndpoint.handle``, which answers it by the call's type.

1. Export (on the prefill rank): ``RankEndpoint.export(attempt, payload)`` keeps the
   payload where the transport can reach it and returns a picklable *locator*, which
   travels to the router inside a ``HandoffTicket``.
2. Deliver (in the router): ``KVTransport.deliver(ticket, src, dst)`` makes the decode
   rank ``dst`` import the payload; its ``DeliveryResult`` says whether the decode rank
   confirmed the import, or why not, as a ``FailureKind`` set where the failure is known
   (``payload``: refused, never retry; ``capacity``: try another rank; ``cache_miss``:
   send it whole; ``transport``: the bytes did not arrive, retry or re-prefill). The
   decode rank's answer (``rank.messages.ImportResult``) is this same type.
3. Receive (on the decode rank): the payload reaches ``RankHost.import_prefilled``
   (as a resolved Ray argument, or pushed over gRPC chunks, ...).
4. Release / discard (router -> prefill rank): the payload is released only after the
   decode rank confirmed its import (``release``), or when its request ended on the way
   (``discard``). Every backend goes through ``KVTransport``'s one release path: each
   call to the source waits at most ``release_timeout_s`` (``RELEASE_TIMEOUT_S``); one
   that passes it is logged and counted (``num_release_timeouts``), never waited for
   longer. An endpoint also forgets payloads nobody asked for within ``max_age_s``, so
   a router that vanished (or a release that never arrived) cannot leak them.

``KVSecret`` is the per-cluster key of transports that authenticate their traffic
(``grpc``): the router makes one at start and hands it to its ranks through Ray only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

log = logging.getLogger(__name__)


class FailureKind(str, Enum):
    """Why a delivery (or the decode rank's import) failed; a ``str`` (its value), so it
    compares, hashes, pickles and serializes as the plain word."""

    NONE = ""  # it did not fail
    PAYLOAD = "payload"  # the decode rank refused the payload: never retry it
    CAPACITY = "capacity"  # the decode rank has no room now: try another
    TRANSPORT = "transport"  # the bytes did not arrive (a rank died, a relay failed)
    CACHE_MISS = "cache_miss"  # it left out a prefix the receiver no longer holds
    # ray's shared-memory path only: the receiver could not map the sender's segment
    # (the router falls back to the object store; never a delivery's final kind)
    UNREACHABLE = "unreachable"

    def __str__(self) -> str:
        return self.value


PAYLOAD, CAPACITY, TRANSPORT = FailureKind.PAYLOAD, FailureKind.CAPACITY, FailureKind.TRANSPORT
CACHE_MISS, UNREACHABLE = FailureKind.CACHE_MISS, FailureKind.UNREACHABLE
# Seconds an exported payload (or an import answer) nobody asked for is kept before it is
# forgotten (every endpoint, staging area and channel): a vanished router leaks nothing.
PAYLOAD_MAX_AGE_S = 600.0
# Seconds the router waits for a source rank to free a payload (release / discard) before
# it logs and counts the call as timed out; the payload then expires on the rank.
RELEASE_TIMEOUT_S = 10.0


@dataclass
class DeliveryResult:
    """One delivery's outcome, and the decode rank's answer to an import (the same type:
    ``rank.messages.ImportResult``). ``kind`` is set where the failure is known; a plain
    word (a wake-channel reply, a test) becomes its ``FailureKind`` (ValueError if none)."""

    ok: bool
    attempt: str = ""
    kind: FailureKind = FailureKind.NONE  # on failure: why
    error: str = ""
    nbytes: int = 0  # the payload's size as it arrived

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FailureKind):
            self.kind = FailureKind(self.kind)


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


def node_id() -> str:
    """This process's Ray node ("" outside a Ray worker: no node to share with)."""
    try:
        # lazy: ray is heavy; a process outside Ray has no node to ask for
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:
        return ""


def payload_without_prefix(data: Any, num_blocks: int) -> bytes:
    """A KV payload's bytes without its first ``num_blocks`` full blocks (the rank side
    of ``deliver(..., skip_blocks)``; imports torch). One that cannot leave a prefix out
    (a sliding-window ring) goes whole: the receiver then finds no blocks skipped."""
    # lazy: engine.kv.payload imports torch; the router imports this module
    from pdserve.engine.kv.payload import KVPayload, KVPayloadError

    try:
        return KVPayload.from_bytes(data).without_prefix(num_blocks).to_bytes()
    except KVPayloadError:
        return data


class KVTransport(ABC):
    """The router's side: deliver, release, discard.

    Release and discard are one path for every backend: ``held_key`` names what the
    source holds for a ticket (None: nothing to tell it), ``_free_on_source`` tells it
    (the source rank's ``release_kv`` / ``release_kv_many`` Ray calls unless a backend
    overrides it), and ``_free`` bounds that call by ``release_timeout_s``: past it, or
    when the call fails, the release is logged and counted, never waited for longer."""

    name: str = ""

    # the deadline of each call that tells a source rank to free payloads
    release_timeout_s: float = RELEASE_TIMEOUT_S

    def __init__(self) -> None:
        self.bytes_moved = 0
        self.num_deliveries = 0
        self.num_release_timeouts = 0  # the source did not answer within the deadline
        self.num_release_errors = 0  # the call failed (a dead source freed it already)

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
        """``release`` of several payloads of one source (a request's streamed chunks),
        in one call to the source."""
        keys = [key for key in map(self.held_key, tickets) if key is not None]
        if keys:
            await self._free(src, keys, many=True)

    async def discard(self, ticket: Any, src: Any) -> None:
        """Free the payload behind ``ticket`` without importing it anywhere."""
        key = self.held_key(ticket)
        if key is not None:
            await self._free(src, [key], many=False)

    def held_key(self, ticket: Any) -> str | None:
        """The key the source holds ``ticket``'s payload under until it is told to free
        it; None when there is nothing to tell (it goes with the router's reference)."""
        return ticket.key

    async def _free_on_source(self, src: Any, keys: list[str], many: bool) -> None:
        """Tell rank ``src`` to free ``keys`` (``many``: one ``release_kv_many`` call,
        else ``release_kv`` of the one key)."""
        if many:
            await src.actor.release_kv_many.remote(keys)
        else:
            await src.actor.release_kv.remote(keys[0])

    async def _free(self, src: Any, keys: list[str], many: bool) -> bool:
        """``_free_on_source`` within ``release_timeout_s``; True once the source
        answered. Past the deadline, or on a failed call, it is logged and counted (the
        payload then expires on the source after its ``max_age_s``)."""
        try:
            await asyncio.wait_for(self._free_on_source(src, keys, many),
                                   self.release_timeout_s)
        except asyncio.TimeoutError:
            self.num_release_timeouts += 1
            log.warning("%s KV release of %d payload(s) (%s) got no answer within %gs",
                        self.name, len(keys), keys[0], self.release_timeout_s)
            return False
        except Exception as exc:  # a dead source holds nothing any more
            self.num_release_errors += 1
            log.info("%s KV release of %d payload(s) (%s) failed: %s: %s", self.name,
                     len(keys), keys[0], type(exc).__name__, exc)
            return False
        return True

    async def close(self) -> None:
        return None

    def delivery_paths(self) -> dict[str, int]:
        """Deliveries so far by the path they took (one path: the transport's name)."""
        return {self.name: self.num_deliveries}

    def _delivered(self, nbytes: int) -> None:
        self.bytes_moved += nbytes
        self.num_deliveries += 1


class DirectHandoff(ABC):
    """A transport whose prefill rank can ask the decode rank for a streamed prompt's
    hand-off itself, as it exports it (ray, one node; router/kv_stream.py, 4): the
    router says where (``tell_direct``) and reads what the decode rank answered
    (``direct_answer``) instead of delivering."""

    num_direct_local = 0  # direct hand-offs answered without a Ray call

    @abstractmethod
    def tell_direct(self, src: Any, attempt: str, dst: Any, reply: str = "",
                    reply_id: str = "") -> Any:
        """Tell prefill rank ``src`` that ``attempt``'s hand-off goes directly to ``dst``
        (None: it does not), answering this router at ``reply`` under ``reply_id`` when
        given; an awaitable the caller bounds."""

    def expect_direct(self, src: Any, dst: Any) -> tuple[str, str]:
        """Where and under which id ``dst`` may answer a direct hand-off from ``src`` to
        the router itself; ("", ""): through the prefill rank's call."""
        return "", ""

    @abstractmethod
    async def direct_answer(self, direct: Any, dst: Any, nbytes: int) -> DeliveryResult:
        """What the decode rank answered a direct hand-off (``direct``: the ticket's
        ``direct_import``), as ``deliver`` would report it."""

    def forget_direct(self, reply_id: str) -> None:
        """An expected answer nobody will wait for (the direct hand-off was called off)."""
        return None


@dataclass(frozen=True)
class EndpointSizing:
    """What a rank's KV cache allows its endpoint (computed by the rank from its engine).

    ``staging_bytes``: memory a sender may keep for payloads on their way (ray's shared
    memory; 0: none). ``max_tokens`` / ``max_tensor_bytes``: the longest sequence the
    rank could ever import, and its KV bytes (0: unknown; a receiver's own default cap
    applies). ``device``: where the engine's KV cache lives ("cpu", "cuda:0")."""

    staging_bytes: int = 0
    max_tokens: int = 0
    max_tensor_bytes: int = 0
    device: str = "cpu"


class RankHost(Protocol):
    """What an endpoint asks of the rank it serves (the decode side's import, and the
    undoing of one whose bytes turned out stale)."""

    def import_prefilled(self, payload: Any, *, borrowed: bool = False,
                         skip_blocks: int = 0) -> DeliveryResult: ...

    def abort(self, attempt: str) -> bool: ...


class RankEndpoint:
    """A rank's side: holds exported payloads until released (kept in this process).

    A backend's endpoint answers its router side's calls by type (``calls``); the rank
    passes them on unread (``EngineRank.kv_call`` -> ``handle``). The other hooks a rank
    calls are the same for every backend: ``payload_buffer`` / ``export`` / ``release``
    (prefill), ``hand_off_directly`` (prefill, after an export), ``listen_for_wakes``
    (decode, once)."""

    address: str | None = None  # where other processes reach this endpoint, if anywhere
    num_woken = 0  # imports a sender's wake started here (ray only)

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

    def calls(self) -> dict[type, Callable[..., Any]]:
        """The router side's calls this endpoint answers, by type (none here)."""
        return {}

    def handle(self, call: Any, *data: Any) -> Any:
        """Answer one call of this backend's router side (``data``: arguments Ray
        resolved for it, such as a payload's ObjectRef)."""
        handler = self.calls().get(type(call))
        if handler is None:
            raise TypeError(f"{type(self).__name__} takes no {type(call).__name__} call")
        return handler(call, *data)

    def hand_off_directly(self, stream_of: str, locator: Any) -> Any:
        """After exporting the hand-off of streamed attempt ``stream_of``: ask its decode
        rank to import it now, if the router said where it goes and the backend can;
        where that rank's answer reaches the router (the ticket's ``direct_import``),
        or None (the router delivers it)."""
        return None

    def listen_for_wakes(self) -> str:
        """Receiver: serve imports asked by other processes on this node without a Ray
        call; the address to give them ("" where the backend has no such channel)."""
        return ""

    def close(self) -> None:
        with self._payloads_lock:
            self._payloads.clear()

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.max_age_s
        for attempt in [a for a, (t, _) in self._payloads.items() if t < cutoff]:
            del self._payloads[attempt]
