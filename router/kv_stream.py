"""KV streamed ahead of a hand-off, the router's side.

A prompt that takes several prefill steps (``AddRequest.stream_kv``) exports the full
blocks each step completes as a chunk (a ``KVChunkTicket``) while the rest computes.

1. The first chunk picks the decode rank the request will most likely decode on
   (``Pool.choose_decode``); each chunk is delivered there as it arrives, in order, one
   at a time (``KVStream.lock``), through the same transport as a hand-off. The decode
   rank writes it into blocks it reserves for the request (a partial import).
2. The hand-off's payload leaves out every streamed block. Its delivery first makes
   its decode rank hold every chunk (``send_chunks``: nothing, if the early deliveries
   all landed there; all of them again, on any other rank), then delivers the payload.
3. A chunk that fails stops the early deliveries (``broken``) and frees the partial
   import; the hand-off then sends every chunk again with its payload, so a failure
   costs time, never tokens.
4. Direct hand-off (ray, one node): once ``dst`` holds the first chunks, the prefill
   rank is told (``DirectHandoff.tell_direct``) to ask ``dst`` for the hand-off's import
   itself as it exports the payload, so the import starts while the first token is on
   its way to the router, not after (``HandoffTicket.direct_import``: that call's
   ObjectRef). On one node the prefill rank wakes ``dst`` through its local socket
   instead, and ``dst`` answers the router there under an id the router gave with its
   word (``direct_reply``; the ticket's ``direct_import`` is then a ``LocalReply``): no
   Ray call, and the import starts ~0.5 ms after the export instead of 2-5 ms
   (kv_transfer/ray/wake_channel.py). The router awaits its answer instead of delivering;
   if it failed (a
   chunk still on its way, ``dst`` full or gone), the import is aborted and the
   hand-off is delivered as in 2, every chunk again. The router stays the one that
   confirms, releases and moves.
5. The chunks stay on the prefill rank until the hand-off is confirmed (``release``)
   or the attempt ends or moves (``discard``, and the decode rank's partial import is
   aborted); a decode rank also drops a partial import nobody continued within
   ``PARTIAL_IMPORT_MAX_AGE_S``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv_transfer.base import TRANSPORT, DeliveryResult, DirectHandoff, KVTransport
from pdserve.rank.messages import AttemptKey
from pdserve.router.rank_handle import DEAD

log = logging.getLogger(__name__)


@dataclass(eq=False)
class KVStream:
    """One attempt's chunks, from its prefill rank ``src``, and which of them ``dst``
    holds (the first ``delivered``)."""

    attempt: AttemptKey
    src: Any
    chunks: list[Any] = field(default_factory=list)
    dst: Any = None
    delivered: int = 0
    broken: bool = False  # early deliveries stopped; the hand-off sends what is missing
    handing_off: bool = False  # the hand-off's delivery took over
    closed: bool = False
    # the decode rank the prefill rank was told to hand off to itself (a direct hand-off)
    direct_dst: Any = None
    # the id its decode rank answers the router under (wake channel), if it was given one
    direct_reply: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def num_blocks(self) -> int:
        return sum(chunk.num_blocks for chunk in self.chunks)


async def send_chunks(transport: KVTransport, stream: KVStream, dst: Any, timeout_s: float,
                      abort_on) -> DeliveryResult:
    """Make ``dst`` hold every chunk of ``stream`` so far, in order (call with
    ``stream.lock`` held). A failure aborts what ``dst`` took of it (``abort_on(rank,
    attempt)``) and is returned as the transport reported it."""
    if stream.dst is not dst:
        if stream.dst is not None and stream.delivered:
            await abort_on(stream.dst, stream.attempt)  # its partial import is not needed
        stream.dst, stream.delivered = dst, 0
    moved = 0
    while stream.delivered < len(stream.chunks):
        chunk = stream.chunks[stream.delivered]
        try:
            result = await asyncio.wait_for(transport.deliver(chunk, stream.src, dst), timeout_s)
        except asyncio.TimeoutError:
            result = DeliveryResult(False, kind=TRANSPORT,
                                    error=f"a KV chunk took longer than {timeout_s:g}s")
        if not result.ok:
            await abort_on(dst, stream.attempt)
            stream.dst, stream.delivered = None, 0
            return result
        stream.delivered += 1
        moved += result.nbytes or chunk.nbytes
    return DeliveryResult(True, nbytes=moved)


class KVStreams:
    """The router's KV streams by attempt: takes each chunk a prefill rank reports,
    delivers the chunks ahead of the hand-off (1 above), tells the prefill rank when a
    direct hand-off can go (4), and frees a stream's chunks once its attempt ends (5).
    ``handoffs`` (router/handoff.py) is set by the router once both exist."""

    def __init__(self, config: Any, decode_pool: Callable[[], Any], transport: KVTransport, *,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
                 abort_on: Callable[[Any, str], Coroutine[Any, Any, None]]) -> None:
        self.config = config
        self.decode_pool = decode_pool
        self.transport = transport
        self.spawn = spawn
        self.abort_on = abort_on
        self.handoffs: Any = None
        self.streams: dict[str, KVStream] = {}  # attempt -> its KV streamed ahead
        self.num_chunks_streamed = 0  # chunks that reached a decode rank ahead of time

    def take_chunk(self, rank: Any, chunk: Any, goes_on: bool) -> None:
        """A chunk ``rank`` exported; ``goes_on``: its attempt is still the request's, on
        that rank (else the chunk is freed at once)."""
        if not goes_on:
            self.spawn(self.transport.discard(chunk, rank))  # its attempt ended or moved
            return
        stream = self.streams.get(chunk.stream_of)
        if stream is None:
            stream = self.streams[chunk.stream_of] = KVStream(chunk.stream_of, rank)
        stream.chunks.append(chunk)
        if not stream.broken:
            self.spawn(self._stream_ahead(stream))

    async def _stream_ahead(self, stream: KVStream) -> None:
        """Deliver the chunks that arrived so far to the stream's decode rank."""
        async with stream.lock:
            if stream.closed or stream.broken or stream.handing_off:
                return
            if stream.dst is None:
                stream.dst = self.decode_pool().choose_decode()
                if stream.dst is None:
                    stream.broken = True  # no decode rank now: the hand-off sends them all
                    return
            before = stream.delivered
            result = await send_chunks(self.transport, stream, stream.dst,
                                       self.config.handoff_timeout_s, self.abort_on)
            if result.ok:
                self.num_chunks_streamed += stream.delivered - before
                if stream.direct_dst is None and self.handoffs.can_hand_off_directly(stream):
                    stream.direct_dst = stream.dst
                    self.spawn(self.handoffs.tell_direct(stream.src, stream.attempt, stream.dst))
            else:
                stream.broken = True
                if stream.direct_dst is not None:  # the hand-off goes through the router
                    self.spawn(self.handoffs.tell_direct(stream.src, stream.attempt, None))
                log.info("streaming KV of %s stopped: %s: %s", stream.attempt, result.kind,
                         result.error)

    def drop(self, attempt: AttemptKey) -> None:
        """The attempt ended or moved before its hand-off: its chunks go."""
        if attempt in self.streams:
            self.spawn(self.close(attempt, imported=False))

    async def close(self, attempt: AttemptKey, imported: bool) -> None:
        """The chunks go from the prefill rank; unless a hand-off imported them, the
        decode rank's partial import goes too."""
        stream = self.streams.pop(attempt, None)
        if stream is None:
            return
        async with stream.lock:  # after a delivery in progress
            stream.closed = True
            dst, partial = stream.dst, stream.delivered > 0
        if stream.direct_reply and isinstance(self.transport, DirectHandoff):
            self.transport.forget_direct(stream.direct_reply)  # nobody awaits it now
        if imported:
            self.spawn(self.transport.release_many(stream.chunks, stream.src))
        else:
            for chunk in stream.chunks:
                self.spawn(self.transport.discard(chunk, stream.src))
        if not imported and partial and dst is not None and dst.state != DEAD:
            await self.abort_on(dst, attempt)
