"""Each step report of a rank, routed to the requests it speaks of.

1. Tokens (``TokenReport``): appended to their request's stream in order; a gap (a lost
   report) or a failed step moves the request; a finish ends it. An attempt nobody
   holds any more is aborted on the rank that still runs it.
2. A direct hand-off's decode rank may report tokens before its prefill rank's ticket
   arrived: those wait on the request (``early_reports``, bounded) and follow the ticket.
3. KV chunks streamed ahead go to ``KVStreams`` (router/kv_stream.py).
4. A hand-off ticket streams each choice's first token at once, then its payload's
   delivery runs as a task (``HandoffDelivery``, router/handoff.py); whatever way it
   ends, its payload and stream are freed and each choice decodes, moves or has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.kv_transfer.base import KVTransport
from pdserve.rank.messages import HandoffTicket, KVChunkTicket, StepReport
from pdserve.router.handoff import HandoffDelivery, HandoffGroup, waits_on
from pdserve.router.kv_stream import KVStreams
from pdserve.router.placement import leave
from pdserve.router.pools import Pool
from pdserve.router.rank_handle import RankHandle
from pdserve.router.request_flow import RequestFlow
from pdserve.router.requests import HANDOFF, PREFILL, RequestTracker

log = logging.getLogger(__name__)
# decode reports a request may hold while its direct hand-off's ticket is on its way
MAX_EARLY_REPORTS = 64


class ReportRouter:
    """Routes rank reports to requests; runs each hand-off's delivery task."""

    def __init__(self, tracker: RequestTracker, transport: KVTransport, flow: RequestFlow,
                 kv_streams: KVStreams, handoffs: HandoffDelivery, *,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
                 abort_on: Callable[[RankHandle, str], Coroutine[Any, Any, None]],
                 stopping: Callable[[], bool]) -> None:
        self.tracker = tracker
        self.transport = transport
        self.flow = flow
        self.kv_streams = kv_streams
        self.handoffs = handoffs
        self.spawn = spawn
        self.abort_on = abort_on
        self.stopping = stopping
        self.num_lost_reports = 0
        self.num_handoffs_in_flight = 0
        self.num_early_reports = 0  # decode reports held until their hand-off's ticket came

    def on_step(self, pool: Pool, rank: RankHandle, step: StepReport) -> None:
        try:
            if step.cache_events:
                rank.apply_cache_events(step.cache_events)
            for out in step.outputs:
                self._route_output(rank, out)
            for chunk in step.kv_chunks:
                self._take_chunk(rank, chunk)
            for ticket in step.handoffs:
                self._route_handoff(rank, ticket)
        except Exception:  # a bug here must not stop the rank's reports
            log.exception("handling a step report of %s failed", rank.name)

    def _route_output(self, rank: RankHandle, out: Any) -> None:
        state = self.tracker.by_attempt(out.attempt)
        if state is None or state.finished:
            if out.finish_reason is None:  # an orphan still running: stop it
                self.spawn(self.abort_on(rank, out.attempt))
            return
        if state.stage == PREFILL and rank is not state.prefill_rank \
                and len(state.early_reports) < MAX_EARLY_REPORTS:
            # its decode rank, handed the KV directly, ahead of the prefill rank's report
            state.early_reports.append((rank, out))
            self.num_early_reports += 1
            return
        if out.timings is not None:
            state.timings.update(out.timings.items())
        if out.num_cached_tokens:
            state.note_cached(out.num_cached_tokens)
        if out.step_failed:
            rank.inflight.discard(out.attempt)
            self.flow.move(state, out.error or "a step failed")
            return
        if out.token_ids and not state.accept(out.token_ids, out.num_output_tokens):
            self.num_lost_reports += 1
            self.flow.move(state, f"a step report of {rank.name} was lost (expected token "
                           f"{state.attempt_tokens + 1}, got {out.num_output_tokens})")
            return
        if out.finish_reason is not None:
            self.flow.finish(state, out.finish_reason, out.error, out.token_ids, out.logprobs)
        else:
            state.push(out.token_ids, out.logprobs)

    def _take_chunk(self, rank: RankHandle, chunk: KVChunkTicket) -> None:
        state = self.tracker.by_attempt(chunk.stream_of)
        goes_on = state is not None and waits_on(state, chunk.stream_of) \
            and state.prefill_rank is rank
        self.kv_streams.take_chunk(rank, chunk, goes_on)

    def _route_handoff(self, rank: RankHandle, ticket: HandoffTicket) -> None:
        group = self._take_handoff(rank, ticket)
        if not group.live:
            if ticket.direct_import is not None:
                self.spawn(self.handoffs.undo_direct(
                    ticket, self.kv_streams.streams.get(ticket.stream_of)))
            self.spawn(self.transport.discard(ticket, rank))
            if ticket.stream_of:
                self.kv_streams.drop(ticket.stream_of)
            return
        for state, _ in group.members:
            state.stage = HANDOFF
            state.handoff_group = [s for s, _ in group.members]
        rank.exports.add(ticket.attempt)
        self.spawn(self._hand_off(group, rank, ticket))
        for state, _ in group.members:  # what a direct hand-off's decode rank said first
            early, state.early_reports = state.early_reports, []
            for decode_rank, out in early:
                self._route_output(decode_rank, out)

    def _take_handoff(self, rank: RankHandle, ticket: HandoffTicket) -> HandoffGroup:
        """Stream each choice's first token (before any KV moves); the ones that go on
        make the hand-off's group."""
        group = HandoffGroup([c.attempt for c in ticket.choices])
        for choice in ticket.choices:
            state = self.tracker.by_attempt(choice.attempt)
            if state is not None and not group.prompt_hashes:
                group.prompt_hashes = state.prompt_hashes
            if state is None or state.finished or state.aborted:
                continue
            if ticket.timings is not None:
                state.timings.update(ticket.timings.items())
            state.timings["kv_bytes"] = ticket.nbytes
            state.note_cached(ticket.num_cached_tokens)
            if not state.accept([choice.first_token_id], 1):
                leave(rank, state)
                self.flow.move(state, f"a hand-off of {rank.name} came out of order")
                continue
            first_lp = choice.first_token_logprobs
            state.push([choice.first_token_id], None if first_lp is None else [first_lp])
            leave(rank, state)
            if state.tokens_left <= 0:
                self.flow.finish(state, "length")
                continue
            group.members.append((state, choice.attempt))
        return group

    async def _hand_off(self, group: HandoffGroup, src: RankHandle,
                        ticket: HandoffTicket) -> None:
        """Deliver the payload to a decode rank; released only once the import is
        confirmed. Never ends without each of its choices moving on: decoding, moved,
        or ended."""
        self.num_handoffs_in_flight += 1  # each holds its payload's ticket
        try:
            await self.handoffs.deliver(group, src, ticket)
        except asyncio.CancelledError:
            if not self.stopping():
                for state in group.live:
                    self.flow.move(state, "the KV hand-off was cancelled")
            raise
        except Exception as exc:  # a bug must not leave the request without a finish
            log.exception("hand-off of %s failed", ticket.attempt)
            for state in group.live:
                self.flow.move(state, f"the KV hand-off failed: {type(exc).__name__}: {exc}")
        finally:
            src.exports.discard(ticket.attempt)
            try:
                if not group.decoding:
                    await self.transport.discard(ticket, src)
                if ticket.stream_of:
                    await self.kv_streams.close(ticket.stream_of, imported=group.decoding)
            finally:
                self.num_handoffs_in_flight -= 1
