"""The KV hand-off's delivery: a prefilled request's payload to a decode rank.

``HandoffDelivery.deliver`` takes one hand-off (the payload's ticket and the group of
choices it carries) to a decode rank, trying up to ``max_handoff_tries`` of them, by
one of four ways: the direct import the prefill rank already asked of the decode rank
that holds the chunks streamed ahead (the direct hand-off), the whole payload again to
a decode rank whose cache lost the prefix it said it held, the rest of the payload to
the decode rank that holds the chunks streamed ahead, or the payload (less the prefix
its cache holds) to the decode rank with the most free blocks. The direct hand-off's
other steps live here too: whether a stream's ranks allow it, telling the prefill rank
where its hand-off goes, and undoing a direct import nobody continues.

The router (``router/service.py``) runs each hand-off as one of its tasks and hands
this object what it needs at construction: its config, pools, transport, metrics, the
KV streams by attempt, and the calls that spawn a task, move or finish a request and
abort an attempt on a rank.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from pdserve.kv_transfer.base import (
    CACHE_MISS,
    PAYLOAD,
    TRANSPORT,
    DeliveryResult,
    DirectHandoff,
    KVTransport,
)
from pdserve.rank.messages import AttemptKey, HandoffTicket
from pdserve.router.config import RouterConfig
from pdserve.router.kv_stream import KVStream, send_chunks
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import decoding_on
from pdserve.router.pools import Pool
from pdserve.router.rank_handle import DEAD, READY, RankHandle
from pdserve.router.requests import DECODE, RequestState


class HandoffGroup:
    """The choices one KV payload carries (n > 1: several; else one) and which of them
    still wait for it: a choice that ended or moved meanwhile has left the group."""

    def __init__(self, attempts: list[AttemptKey]) -> None:
        self.attempts = attempts  # every choice the payload carries, the lead first
        self.members: list[tuple[RequestState, str]] = []  # joined: (state, its attempt)
        self.decoding = False  # the payload reached a decode rank for at least one
        self.prompt_hashes: list[bytes] = []  # the payload's prompt blocks' names

    @property
    def live(self) -> list[RequestState]:
        return [s for s, key in self.members if waits_on(s, key)]

    @property
    def live_attempts(self) -> set[str]:
        return {key for s, key in self.members if waits_on(s, key)}


def waits_on(state: RequestState, attempt: AttemptKey) -> bool:
    """Whether ``attempt`` is the request's current one and the request goes on."""
    return not (state.finished or state.aborted) and state.attempt_key == attempt


@dataclasses.dataclass
class _Delivery:
    """One hand-off's way to a decode rank: what its tries share."""

    group: HandoffGroup
    src: RankHandle
    ticket: HandoffTicket
    pool: Pool  # the decode pool
    started: float
    stream: KVStream | None  # its KV streamed ahead, if any
    direct: Any  # the direct import's answer, still to be awaited (or None)
    hashes: list[bytes]  # the prompt blocks a decode rank's cache may hold
    tried: set[int] = dataclasses.field(default_factory=set)
    retry_whole: RankHandle | None = None  # its cache lost the prefix: send it all
    last_error: str = ""


class HandoffDelivery:
    """Delivers hand-offs to decode ranks; the direct hand-off's steps; its counters."""

    def __init__(self, config: RouterConfig, pools: Mapping[str, Pool], transport: KVTransport,
                 metrics: RouterMetrics, streams: Mapping[str, KVStream], *,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
                 move: Callable[[RequestState, str], None],
                 finish: Callable[[RequestState, str, str], None],
                 abort_on: Callable[[RankHandle, str], Coroutine[Any, Any, None]]) -> None:
        self.config = config
        self.pools = pools
        self.transport = transport
        self.metrics = metrics
        self.streams = streams  # attempt -> its KV streamed ahead (the router's)
        self.spawn = spawn
        self.move = move
        self.finish = finish
        self.abort_on = abort_on
        self.num_kv_blocks_skipped = 0  # KV blocks a decode rank's cache held: not sent
        self.num_direct_handoffs = 0  # hand-offs a prefill rank had its decode rank import
        self.num_direct_refused = 0  # ... that the decode rank refused (then delivered)

    # -- delivery --------------------------------------------------------------------

    async def deliver(self, group: HandoffGroup, src: RankHandle,
                      ticket: HandoffTicket) -> None:
        """Try decode ranks until one imports the payload, its choices move (payload
        lost, a timeout, no decode rank took it) or end (the payload was rejected)."""
        pool = self.pools["decode"]
        started = time.monotonic()
        d = self._begin(group, src, ticket, pool, started)
        if d is None:
            return
        for _ in range(self.config.max_handoff_tries):
            dst, skip = await self._choose(d)
            if not group.live:
                return
            if dst is None:
                break
            if await self._try(d, dst, skip):
                return
        for state in group.live:
            self.move(state, "no decode rank could take the prefilled request"
                      + (f" (last: {d.last_error})" if d.last_error else ""))

    def _begin(self, group: HandoffGroup, src: RankHandle, ticket: HandoffTicket, pool: Pool,
               started: float) -> _Delivery | None:
        """The delivery's shared state; None when the chunks streamed ahead of it were
        lost (its choices moved)."""
        hashes = group.prompt_hashes if self.config.routing == "cache_aware" else []
        stream = self.streams.get(ticket.stream_of) if ticket.streamed_blocks else None
        if ticket.streamed_blocks and (stream is None or stream.num_blocks != ticket.streamed_blocks):
            if ticket.direct_import is not None:
                self.spawn(self.undo_direct(ticket, stream))
            for state in group.live:  # its payload is incomplete without them
                self.move(state, "the KV chunks streamed ahead of its hand-off were lost")
            return None
        direct = ticket.direct_import if stream is not None and stream.direct_dst is not None \
            else None
        if ticket.direct_import is not None and direct is None:
            self.spawn(self.undo_direct(ticket, stream))
        if stream is not None:
            stream.handing_off = True
            hashes = []  # the payload already leaves out what went ahead
        return _Delivery(group, src, ticket, pool, started, stream, direct, hashes)

    async def _choose(self, d: _Delivery) -> tuple[RankHandle | None, int]:
        """The next decode rank to try, and the leading blocks its cache holds (left
        out of the payload); None when no decode rank is ready."""
        stream = d.stream
        if d.direct is not None:
            return stream.direct_dst, 0  # it was asked for the import already
        if d.retry_whole is not None:
            dst, d.retry_whole = d.retry_whole, None
            return dst, 0
        if stream is not None and stream.dst is not None and not stream.broken \
                and stream.dst.state == READY and stream.dst.uid not in d.tried:
            return stream.dst, 0  # it holds the chunks already
        dst = await d.pool.wait_for_decode(d.tried, self.config.rank_wait_s,
                                           lambda: not d.group.live, d.hashes)
        # the prefix the decode rank's cache holds stays on the prefill rank
        skip = dst.cached_prefix_blocks(d.hashes) if dst is not None and d.hashes else 0
        return dst, skip

    async def _try(self, d: _Delivery, dst: RankHandle, skip: int) -> bool:
        """One try on ``dst``; True when the hand-off is over (delivered, or its
        choices moved or ended), False to try the next decode rank."""
        d.tried.add(dst.uid)
        for state, key in d.group.members:
            decoding_on(dst, state, key)
        result = await self._import(d, dst, skip)
        if result is None:
            return True
        if result.ok:
            await self._delivered(d, dst, skip, result)
            return True
        return await self._refused(d, dst, skip, result)

    async def _import(self, d: _Delivery, dst: RankHandle, skip: int) -> DeliveryResult | None:
        """``dst``'s import of the payload; None when it timed out (the choices moved)."""
        dst.pending_imports += 1
        try:
            try:
                if d.direct is not None:
                    result, d.direct = await self._direct_result(d.direct, d.ticket, dst), None
                    self.num_direct_handoffs += result.ok
                    self.num_direct_refused += not result.ok
                else:
                    result = await self._deliver_to(d.ticket, d.src, dst, skip, d.stream)
            except asyncio.TimeoutError:
                # The import may still land: the attempts move, so a late one is stale.
                for key in d.group.attempts:
                    self.spawn(self.abort_on(dst, key))
                for state in d.group.live:
                    self.move(state, f"the KV hand-off to {dst.name} timed out after "
                              f"{self.config.handoff_timeout_s:g}s")
                return None
        finally:
            dst.pending_imports -= 1
        return result

    async def _delivered(self, d: _Delivery, dst: RankHandle, skip: int,
                         result: DeliveryResult) -> None:
        """``dst`` imported the payload: released, and its choices decode there."""
        group = d.group
        took = time.monotonic() - d.started
        self.metrics.handed_off(result.nbytes or d.ticket.nbytes, took)
        self.num_kv_blocks_skipped += skip
        self.spawn(self.transport.release(d.ticket, d.src))
        live, live_keys = group.live, group.live_attempts
        for key in group.attempts:  # choices that ended meanwhile, or never joined
            if key not in live_keys:
                dst.inflight.discard(key)
                await self.abort_on(dst, key)
        for state in live:
            state.timings["kv_handoff_s"] = took
            state.handoff_group = None
            if dst.state == DEAD:  # it died while importing: its poller missed it
                self.move(state, f"{dst.name} died during the hand-off")
            else:
                state.stage = DECODE
                group.decoding = True

    async def _refused(self, d: _Delivery, dst: RankHandle, skip: int,
                       result: DeliveryResult) -> bool:
        """``dst`` did not import it; True when the hand-off is over (the payload was
        rejected or lost), False to try the next decode rank."""
        group = d.group
        for key in group.attempts:
            dst.inflight.discard(key)
        d.last_error = result.error
        await self._drop_chunks_on(d.stream, dst)
        if not group.live:
            return True
        if result.kind == PAYLOAD:
            for state in group.live:
                self.finish(state, "error", f"KV payload rejected by {dst.name}: {result.error}")
            return True
        if result.kind == CACHE_MISS:  # evicted since it said so: the whole payload
            dst.cached_blocks.difference_update(d.hashes[:skip])
            d.retry_whole = dst
            return False
        if result.kind == TRANSPORT:
            for key in group.attempts:  # in case half of it arrived
                await self.abort_on(dst, key)
            if d.src.state == DEAD:
                for state in group.live:
                    self.move(state, f"KV payload lost: {d.src.name} died")
                return True
        # capacity, a decode rank gone, or a failed relay: try the next one
        return False

    async def _drop_chunks_on(self, stream: KVStream | None, dst: RankHandle) -> None:
        """What a decode rank that refused the payload took of the chunks goes."""
        if stream is not None and stream.dst is dst:
            async with stream.lock:
                await self.abort_on(dst, stream.attempt)
                stream.dst, stream.delivered = None, 0

    async def _deliver_to(self, ticket: HandoffTicket, src: RankHandle, dst: RankHandle,
                          skip: int, stream: KVStream | None) -> DeliveryResult:
        """The payload to ``dst``, after every chunk that went ahead of it."""
        if stream is not None:
            async with stream.lock:
                sent = await send_chunks(self.transport, stream, dst,
                                         self.config.handoff_timeout_s, self.abort_on)
            if not sent.ok:
                return sent
        return await asyncio.wait_for(self.transport.deliver(ticket, src, dst, skip_blocks=skip),
                                      self.config.handoff_timeout_s)

    # -- the direct hand-off ---------------------------------------------------------

    def can_hand_off_directly(self, stream: KVStream) -> bool:
        """A direct hand-off needs the transport's support and both ranks on one node
        (the decode rank maps the prefill rank's shared memory)."""
        src, dst = stream.src, stream.dst
        if not isinstance(self.transport, DirectHandoff) or dst is None or dst.state != READY:
            return False
        src_node = getattr(src.info, "node_id", "") if src.info else ""
        return bool(src_node) and src_node == (getattr(dst.info, "node_id", "") if dst.info else "")

    async def tell_direct(self, src: RankHandle, attempt: AttemptKey, dst: RankHandle | None) -> None:
        """Tell ``src`` where ``attempt``'s hand-off goes directly (None: nowhere), and,
        on one node, where and under which id ``dst`` answers this router. Lost word
        costs only speed: the router delivers what the prefill rank does not."""
        stream = self.streams.get(attempt)
        reply, reply_id = "", ""
        if dst is not None and dst.info and getattr(dst.info, "wake_address", "") \
                and stream is not None and not stream.direct_reply:
            reply, reply_id = self.transport.expect_direct(src, dst)
            stream.direct_reply = reply_id
        try:
            await asyncio.wait_for(self.transport.tell_direct(src, attempt, dst, reply, reply_id),
                                   self.config.rank_call_timeout_s)
        except Exception:
            pass

    async def _direct_result(self, ref: Any, ticket: HandoffTicket,
                             dst: RankHandle | None) -> DeliveryResult:
        """What the decode rank answered the prefill rank's direct import (to this router
        through the wake channel, or to the prefill rank's Ray call), within the
        hand-off's deadline (asyncio.TimeoutError past it, as a delivery's)."""
        return await asyncio.wait_for(self.transport.direct_answer(ref, dst, ticket.nbytes),
                                      self.config.handoff_timeout_s)

    async def undo_direct(self, ticket: HandoffTicket, stream: KVStream | None) -> None:
        """A direct import nobody continues: once it answered, abort what it took."""
        dst = stream.direct_dst if stream is not None else None
        try:
            answer = await self._direct_result(ticket.direct_import, ticket, dst)
        except Exception:
            answer = None
        # a refusal took nothing; after a failed transport it may have (abort is harmless)
        if dst is not None and dst.state != DEAD and (
                answer is None or answer.ok or answer.kind == TRANSPORT):
            for choice in ticket.choices:
                await self.abort_on(dst, choice.attempt)
