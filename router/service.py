"""The router's request flow, independent of gRPC (server.py adapts it).

Disaggregated: validate -> tokenize -> least-loaded prefill rank -> first token
streamed at once -> KV payload handed to the decode rank with the most free blocks
-> each decode step's tokens fanned out to the client streams. Normal: one pool of
NORMAL ranks does both phases. Every request ends with exactly one finish event;
an abort (client gone, deadline, `Abort`) reaches the request wherever it is.

The KV hand-off's delivery to a decode rank (its four ways, the direct hand-off, its
counters) lives in router/handoff.py (``HandoffDelivery``); ``_hand_off`` here runs
each one as a task and cleans up after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
import ray

from pdserve.kv_transfer import KVSecret, make_transport
from pdserve.planner.latency_window import RecentLatencies
from pdserve.rank.messages import (
    AddRequest,
    EngineStats,
    ForkSpec,
    HandoffTicket,
    KVChunkTicket,
    StepReport,
)
from pdserve.router.config import RouterConfig
from pdserve.router.handoff import HandoffDelivery, HandoffGroup, waits_on
from pdserve.router.kv_stream import KVStream, send_chunks
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pools import DEAD, Pool, PromptBlocks, RankHandle
from pdserve.router.requests import DECODE, HANDOFF, PREFILL, QUEUED, RequestState, RequestTracker
from pdserve.router.validation import ModelLimits, PreparedRequest, RequestError

log = logging.getLogger(__name__)
# decode reports a request may hold while its direct hand-off's ticket is on its way
MAX_EARLY_REPORTS = 64


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        config.validate()
        if config.kv_transport == "auto":  # decided once, here: the ranks get the result
            resolved = config.resolved_kv_transport()
            log.info("kv_transport auto: %s (prefill num_gpus %g, decode num_gpus %g)",
                     resolved, config.prefill.num_gpus, config.decode.num_gpus)
            config = dataclasses.replace(config, kv_transport=resolved)
        self.config = config
        self.tracker = RequestTracker(config.max_queue_depth)
        # The cluster's KV key: the grpc transport authorizes every transfer with it; it
        # reaches the ranks only as an actor argument (Pool._new_actor), never a file,
        # the environment or a log (KVSecret's repr hides it).
        self._kv_secret = KVSecret.generate() if config.kv_transport == "grpc" else None
        self.transport = make_transport(config.kv_transport, secret=self._kv_secret,
                                        timeout_s=config.handoff_timeout_s)
        self.pools: dict[str, Pool] = {p.name: Pool(p, config, kv_secret=self._kv_secret)
                                       for p in config.pools()}
        for pool in self.pools.values():
            pool.on_new_rank = self._start_polling
            pool.on_rank_removed = self._requests_left_on
        self.tokenizer: Any = None
        self.chat_template: Any = None  # the model's (ChatTemplate), None when it has none
        self.limits: ModelLimits | None = None
        # the configured one until the ranks (they must agree) say theirs at start
        self.block_size = config.pools()[0].engine.block_size
        self.num_rank_failures = 0
        self.num_moves = 0
        self.num_lost_reports = 0
        self.num_handoffs_in_flight = 0
        self.num_kv_chunks_streamed = 0  # chunks that reached a decode rank ahead of time
        self.num_early_reports = 0  # decode reports held until their hand-off's ticket came
        self._streams: dict[str, KVStream] = {}  # attempt -> its KV streamed ahead
        # Recent TTFT and inter-token samples by rank: the planner's, and status'.
        self.latencies = RecentLatencies(config.planner_window_s)
        self.planner = None  # the SLO planner's loop (planner/loop.py), with autoscale
        self.metrics = RouterMetrics(self)
        # the KV hand-off's delivery (router/handoff.py), with its counters
        self.handoffs = HandoffDelivery(config, self.pools, self.transport, self.metrics,
                                        self._streams, spawn=self.spawn, move=self._move,
                                        finish=self._finish, abort_on=self._abort_on)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False

    @property
    def num_kv_blocks_skipped(self) -> int:
        """KV blocks a decode rank's cache held: not sent."""
        return self.handoffs.num_kv_blocks_skipped

    @property
    def num_direct_handoffs(self) -> int:
        """Hand-offs a prefill rank had its decode rank import."""
        return self.handoffs.num_direct_handoffs

    @property
    def num_direct_refused(self) -> int:
        """Direct hand-offs the decode rank refused (then the router delivered them)."""
        return self.handoffs.num_direct_refused

    @property
    def num_direct_local(self) -> int:
        """Direct hand-offs whose answer came through the wake channel, not Ray."""
        return self.handoffs.num_direct_local

    @property
    def num_kv_streams(self) -> int:
        """Requests whose KV is being streamed ahead of their hand-off."""
        return len(self._streams)

    @property
    def disaggregated(self) -> bool:
        return self.config.mode == "disaggregated"

    @property
    def entry_pool(self) -> Pool:
        return self.pools["prefill" if self.disaggregated else "normal"]

    # -- start / stop ----------------------------------------------------------------

    async def start(self) -> None:
        from pdserve.engine.tokenizer import Tokenizer  # tokenizers only; no torch
        from pdserve.router.chat_template import ChatTemplate

        self.tokenizer = Tokenizer.from_model(self.config.model_dir)
        self.chat_template = ChatTemplate.from_model_dir(self.config.model_dir)
        await asyncio.gather(*(p.start() for p in self.pools.values()))
        infos = [r.info for p in self.pools.values() for r in p.ranks]
        max_len = min(i.max_model_len for i in infos)
        vocab = min(i.vocab_size for i in infos)
        block_sizes = {i.block_size for i in infos}
        if len(block_sizes) != 1:
            raise RuntimeError(f"ranks disagree on block_size: {sorted(block_sizes)}")
        self.block_size = block_sizes.pop()
        limit = self.config.max_tokens_limit or max_len - 1
        self.limits = ModelLimits(vocab_size=vocab, max_model_len=max_len, max_tokens_limit=limit,
                                  max_choices=self.config.max_choices)
        self.spawn(self._watch_stalls())
        if self.config.autoscale:
            from pdserve.planner.loop import PlannerLoop  # drives this (a PlannerHost)

            self.planner = PlannerLoop(self)
            self.spawn(self.planner.run())

    async def stop(self) -> None:
        self._stopping = True
        for state in self.tracker.states():
            state.finish("abort", "the router is shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(p.stop() for p in self.pools.values()), return_exceptions=True)
        await self.transport.close()

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` as one of the router's tasks: kept until done, cancelled at stop
        (the planner's resizes run here too: planner/host.py)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- requests --------------------------------------------------------------------

    def admit(self, request: PreparedRequest, client_gone: Callable[[], bool] | None = None,
              tenant: str = "") -> list[RequestState]:
        """Register a validated request (ALREADY_EXISTS / RESOURCE_EXHAUSTED) and send it:
        one state per choice (``request.n``, the lead first), prefilled together. One
        whose label an ``Abort`` named before it arrived ends at once with "abort".
        ``client_gone`` tells whether the caller's stream is already cancelled: a label
        held by such a request is free (its cancel may still be on its way to us)."""
        label = request.request_id
        holder = self.tracker.by_label(label, tenant) if label else None
        if holder is not None and holder.client_gone is not None and holder.client_gone():
            for choice in holder.siblings or [holder]:
                self.end_now(choice, "client disconnected")
        lead = self.tracker.register(request, tenant)
        states = lead.siblings or [lead]
        for state in states:
            state.client_gone = client_gone
        if lead.label_chosen and self.tracker.take_early_abort(lead.label, tenant):
            for state in states:
                state.aborted = True
                self._finish(state, "abort", "aborted by the client before the request arrived")
            return states
        self.spawn(self._dispatch(lead))
        return states

    async def _dispatch(self, state: RequestState) -> None:
        """Start the request's next attempt on the least-loaded entry rank, with the
        choices that join it (n > 1: their first attempt shares its prefill)."""
        state.joins_lead = False  # it goes now, on its own or leading the others
        try:
            await self._dispatch_with_forks(state)
        finally:
            for s in state.siblings:  # the lead ended before them: each goes on its own
                if s.joins_lead and s.stage == QUEUED and not (s.finished or s.aborted):
                    s.joins_lead = False
                    self.spawn(self._dispatch(s))

    async def _dispatch_with_forks(self, state: RequestState) -> None:
        pool = self.entry_pool
        while not (state.finished or state.aborted):
            history = len(state.request.prompt_token_ids) + len(state.tokens)
            if state.tokens_left <= 0 or history >= self.limits.max_model_len:
                # every token arrived (only the finish was lost), or the history fills
                # the model's length: the engine would have stopped here too
                self._finish(state, "length")
                return
            if state.attempt >= self.config.max_attempts:
                self._finish(state, "error", f"no {pool.name} rank could finish the request "
                             f"after {state.attempt} attempts"
                             + (f" (last: {state.error_hint})" if state.error_hint else ""))
                return
            computed = state.request.prompt_token_ids + state.tokens
            prompt = (PromptBlocks.of(computed, self.block_size)  # hashed only to be matched
                      if self.config.routing == "cache_aware"
                      else PromptBlocks(len(computed), self.block_size, []))
            rank = await pool.wait_for_rank(self.config.rank_wait_s,
                                            lambda: state.finished or state.aborted, prompt)
            if state.finished or state.aborted:
                return
            if rank is None:
                self._finish(state, "error", f"no {pool.name} rank is available")
                return
            forks = [s for s in state.siblings if s.joins_lead and not (s.finished or s.aborted)]
            add = self._begin_on(rank, state)
            add.forks = [ForkSpec(self._begin_on(rank, s).attempt, s.request.sampling)
                         for s in forks]
            add.stream_kv = self.disaggregated and self.config.kv_streaming
            # what the rank computes: the prompt past the prefix its cache holds
            state.outstanding = len(add.prompt_token_ids) - prompt.cached_tokens
            rank.outstanding_tokens += state.outstanding
            state.pending_blocks = prompt.hashes
            rank.add_pending(prompt.hashes)
            for s in (state, *forks):  # what a decode rank may already hold of it
                s.prompt_hashes = prompt.hashes
            started = [(state, add.attempt), *((s, s.attempt_key) for s in forks)]
            try:
                result = await asyncio.wait_for(rank.actor.add_request.remote(add),
                                                self.config.rank_call_timeout_s)
            except Exception as exc:  # the rank died or hung on the way: try another
                if state.attempt_key != add.attempt or add.attempt not in rank.inflight:
                    return  # _rank_died got there first and has already moved them
                for s, key in started:
                    if s.attempt_key == key:
                        self._leave(rank, s)
                        s.stage = QUEUED  # no attempt runs while it waits for the next rank
                        s.error_hint = f"add_request on {rank.name}: {type(exc).__name__}"
                log.warning("add_request on %s failed: %s", rank.name, exc)
                for _, key in started:
                    await self._abort_on(rank, key)
                continue
            for s, key in started:
                if s.attempt_key != key:
                    continue  # moved meanwhile (its rank died): it goes on elsewhere
                if not result.ok:
                    self._leave(rank, s)
                    self._finish(s, "error", f"{pool.name} rank refused the request: {result.error}")
                elif s.aborted or s.finished:  # ended while add_request was on its way
                    await self._abort_on(rank, key)
            return

    def _begin_on(self, rank: RankHandle, state: RequestState) -> AddRequest:
        """The request's next attempt, placed on ``rank`` (sent by the caller)."""
        add = state.begin_attempt()
        state.stage = PREFILL if self.disaggregated else DECODE
        state.prefill_rank = rank if self.disaggregated else None
        state.decode_rank = None if self.disaggregated else rank
        state.outstanding = 0
        rank.inflight.add(add.attempt)
        if state.dispatched_at is None:
            state.dispatched_at = time.monotonic()
            state.timings["router_queue_s"] = state.dispatched_at - state.created
        return add

    def _move(self, state: RequestState, why: str) -> None:
        """Start the request again elsewhere from its history (prompt + tokens already
        streamed), leaving its current attempt wherever it is (aborted if reachable)."""
        if state.finished or state.aborted or state.stage == QUEUED:
            return  # ended, or already moving (its next attempt is not dispatched yet)
        old = state.attempt_key
        state.early_reports = []  # the attempt's, and it goes
        for rank in _ranks_of(state):
            if old in rank.inflight and rank.state != DEAD:
                self.spawn(self._abort_on(rank, old))
        if state.stage != HANDOFF:  # in a hand-off, its delivery task closes the stream
            self._drop_stream(old)
        self._leave(state.prefill_rank, state)
        self._leave(state.decode_rank, state)
        state.prefill_rank = state.decode_rank = None
        state.stage = QUEUED
        state.handoff_group = None
        state.num_moves += 1
        state.error_hint = why
        self.num_moves += 1
        log.info("moving request %s (attempt %d): %s", state.label, state.attempt, why)
        self.spawn(self._dispatch(state))

    def _leave(self, rank: RankHandle | None, state: RequestState) -> None:
        if rank is None:
            return
        key = state.attempt_key
        if key in rank.inflight:
            rank.inflight.discard(key)
            if rank.pool in ("prefill", "normal"):
                rank.outstanding_tokens = max(0, rank.outstanding_tokens - state.outstanding)
        if state.pending_blocks and rank.pool in ("prefill", "normal"):
            # computed (its names arrive as cache events) or never will be here
            rank.drop_pending(state.pending_blocks)
            state.pending_blocks = []

    def _finish(self, state: RequestState, reason: str, error: str | None = None,
                token_ids: list[int] | None = None, logprobs: list | None = None) -> None:
        if state.stage != HANDOFF:
            self._drop_stream(state.attempt_key)
        state.finish(reason, error, token_ids, logprobs)
        self._leave(state.prefill_rank, state)
        self._leave(state.decode_rank, state)

    async def _abort_on(self, rank: RankHandle, attempt: str) -> None:
        try:
            await asyncio.wait_for(rank.actor.abort.remote(attempt),
                                   self.config.rank_call_timeout_s)
        except Exception:  # a dead rank holds nothing; a hung one is the poller's business
            pass

    async def abort(self, label: str, reason: str = "aborted by the client",
                    tenant: str = "") -> bool:
        """End ``tenant``'s request in flight under ``label`` (only that one) with "abort"."""
        state = self.tracker.by_label(label, tenant)
        if state is None:  # not here (yet): a Generate with this label may be on its way
            self.tracker.remember_early_abort(label, tenant)
            return False
        await asyncio.gather(*(task for choice in state.siblings or [state]
                               for task in self.end_now(choice, reason)))
        return True

    async def end(self, state: RequestState, reason: str) -> None:
        """End a request with "abort" wherever it is (client gone, deadline, Abort)."""
        await asyncio.gather(*self.end_now(state, reason))

    def end_now(self, state: RequestState, reason: str,
                finish_reason: str = "abort") -> list[asyncio.Task]:
        """`end`, with the request (and its label) finished before this returns; the
        aborts on its ranks run in the returned tasks. ``finish_reason`` "stop": the
        router itself found the end (a stop string), so ``reason`` is no error."""
        if state.finished:
            return []
        state.aborted = True
        attempt = state.attempt_key
        ranks = _ranks_of(state)
        if state.stage == HANDOFF and any(not (s is state or s.finished or s.aborted)
                                          for s in state.handoff_group or ()):
            # its payload still carries choices that go on: the delivery task ends this
            # one on the decode rank once the payload is there (the prefill rank, which
            # holds the payload under the lead's attempt, must keep it)
            ranks = [r for r in ranks if r is not state.prefill_rank]
        self._finish(state, finish_reason, reason if finish_reason != "stop" else None)
        # HANDOFF: the delivery task sees `aborted` and cleans up after itself.
        return [self.spawn(self._abort_on(r, attempt)) for r in ranks if r.state != DEAD]

    async def _watch_stalls(self) -> None:
        """Move attempts that made no progress for request_stall_timeout_s: the last
        bound, for a report lost with nothing after it to reveal the gap."""
        limit = self.config.request_stall_timeout_s
        while not self._stopping:
            await asyncio.sleep(min(1.0, limit / 10))
            now = time.monotonic()
            for state in self.tracker.states():
                if state.stage in (PREFILL, DECODE) and not state.aborted \
                        and now - state.progress_at > limit:
                    self._move(state, f"no progress for {limit:g}s")

    # -- rank reports ----------------------------------------------------------------

    def _start_polling(self, pool: Pool, rank: RankHandle) -> None:
        rank.poll_task = self.spawn(self._poll(pool, rank))

    async def _poll(self, pool: Pool, rank: RankHandle) -> None:
        while not self._stopping and rank.state != DEAD:
            try:
                reply = await asyncio.wait_for(
                    rank.actor.poll.remote(self.config.poll_timeout_s),
                    self.config.rank_unresponsive_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    exc = TimeoutError(f"no reply to a poll for {self.config.rank_unresponsive_s:g}s")
                if rank.state != DEAD:
                    await self._rank_died(pool, rank, f"{type(exc).__name__}: {exc}")
                return
            rank.stats = reply.stats
            for step in reply.steps:
                self._on_step(pool, rank, step)
            if reply.fatal:
                await self._rank_died(pool, rank, f"it gave up: {reply.loop_error}")
                return
            if reply.loop_error and reply.generation == pool.generation \
                    and not pool.lock.locked() and rank.failed_generation != reply.generation:
                # Counted once per group generation: a loop that failed reports it on
                # every poll until the group re-forms.
                rank.error = reply.loop_error
                rank.failed_generation = reply.generation
                rank.num_loop_failures += 1
                if rank.num_loop_failures > self.config.max_group_heals:
                    await self._rank_died(pool, rank, f"its engine loop failed "
                                          f"{rank.num_loop_failures} times; last: {reply.loop_error}")
                    return
                log.warning("%s: engine loop failed (%s); re-forming the group",
                            rank.name, reply.loop_error)
                self.spawn(pool.heal(reply.generation))
            elif reply.steps and not reply.loop_error:
                rank.num_loop_failures = 0

    def _requests_left_on(self, pool: Pool, rank: RankHandle, why: str) -> None:
        for key in list(rank.inflight):
            rank.inflight.discard(key)
            state = self.tracker.by_attempt(key)
            if state is not None and not state.finished and state.stage != HANDOFF:
                self._move(state, why)

    def _on_step(self, pool: Pool, rank: RankHandle, step: StepReport) -> None:
        try:
            if step.cache_events:
                rank.apply_cache_events(step.cache_events)
            self._route_step(rank, step)
        except Exception:  # a bug here must not stop the rank's reports
            log.exception("handling a step report of %s failed", rank.name)

    def _route_step(self, rank: RankHandle, step: StepReport) -> None:
        for out in step.outputs:
            self._route_output(rank, out)
        for chunk in step.kv_chunks:
            self._take_chunk(rank, chunk)
        for ticket in step.handoffs:
            self._route_handoff(rank, ticket)

    def _route_output(self, rank: RankHandle, out: Any) -> None:
        state = self.tracker.by_attempt(out.attempt)
        if state is None or state.finished:
            if out.finish_reason is None:  # an orphan still running: stop it
                self.spawn(self._abort_on(rank, out.attempt))
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
            self._move(state, out.error or "a step failed")
            return
        if out.token_ids and not state.accept(out.token_ids, out.num_output_tokens):
            self.num_lost_reports += 1
            self._move(state, f"a step report of {rank.name} was lost (expected token "
                       f"{state.attempt_tokens + 1}, got {out.num_output_tokens})")
            return
        if out.finish_reason is not None:
            self._finish(state, out.finish_reason, out.error, out.token_ids, out.logprobs)
        else:
            state.push(out.token_ids, out.logprobs)

    def _route_handoff(self, rank: RankHandle, ticket: HandoffTicket) -> None:
        group = self._take_handoff(rank, ticket)
        if not group.live:
            if ticket.direct_import is not None:
                self.spawn(self.handoffs.undo_direct(ticket, self._streams.get(ticket.stream_of)))
            self.spawn(self.transport.discard(ticket, rank))
            if ticket.stream_of:
                self._drop_stream(ticket.stream_of)
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

    # -- KV streamed ahead (router/kv_stream.py) -----------------------------------

    def _take_chunk(self, rank: RankHandle, chunk: KVChunkTicket) -> None:
        state = self.tracker.by_attempt(chunk.stream_of)
        if state is None or not waits_on(state, chunk.stream_of) \
                or state.prefill_rank is not rank:
            self.spawn(self.transport.discard(chunk, rank))  # its attempt ended or moved
            return
        stream = self._streams.get(chunk.stream_of)
        if stream is None:
            stream = self._streams[chunk.stream_of] = KVStream(chunk.stream_of, rank)
        stream.chunks.append(chunk)
        if not stream.broken:
            self.spawn(self._stream_ahead(stream))

    async def _stream_ahead(self, stream: KVStream) -> None:
        """Deliver the chunks that arrived so far to the stream's decode rank."""
        async with stream.lock:
            if stream.closed or stream.broken or stream.handing_off:
                return
            if stream.dst is None:
                stream.dst = self.pools["decode"].choose_decode()
                if stream.dst is None:
                    stream.broken = True  # no decode rank now: the hand-off sends them all
                    return
            before = stream.delivered
            result = await send_chunks(self.transport, stream, stream.dst,
                                       self.config.handoff_timeout_s, self._abort_on)
            if result.ok:
                self.num_kv_chunks_streamed += stream.delivered - before
                if stream.direct_dst is None and self.handoffs.can_hand_off_directly(stream):
                    stream.direct_dst = stream.dst
                    self.spawn(self.handoffs.tell_direct(stream.src, stream.attempt, stream.dst))
            else:
                stream.broken = True
                if stream.direct_dst is not None:  # the hand-off goes through the router
                    self.spawn(self.handoffs.tell_direct(stream.src, stream.attempt, None))
                log.info("streaming KV of %s stopped: %s: %s", stream.attempt, result.kind,
                         result.error)

    def _drop_stream(self, attempt: str) -> None:
        if attempt in self._streams:
            self.spawn(self._close_stream(attempt, imported=False))

    async def _close_stream(self, attempt: str, imported: bool) -> None:
        """The chunks go from the prefill rank; unless a hand-off imported them, the
        decode rank's partial import goes too."""
        stream = self._streams.pop(attempt, None)
        if stream is None:
            return
        async with stream.lock:  # after a delivery in progress
            stream.closed = True
            dst, partial = stream.dst, stream.delivered > 0
        if stream.direct_reply:  # an answer nobody awaits now (a no-op once awaited)
            self.transport.forget_direct(stream.direct_reply)
        if imported:
            self.spawn(self.transport.release_many(stream.chunks, stream.src))
        else:
            for chunk in stream.chunks:
                self.spawn(self.transport.discard(chunk, stream.src))
        if not imported and partial and dst is not None and dst.state != DEAD:
            await self._abort_on(dst, attempt)

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
                self._leave(rank, state)
                self._move(state, f"a hand-off of {rank.name} came out of order")
                continue
            first_lp = choice.first_token_logprobs
            state.push([choice.first_token_id], None if first_lp is None else [first_lp])
            self._leave(rank, state)
            if state.tokens_left <= 0:
                self._finish(state, "length")
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
            if not self._stopping:
                for state in group.live:
                    self._move(state, "the KV hand-off was cancelled")
            raise
        except Exception as exc:  # a bug must not leave the request without a finish
            log.exception("hand-off of %s failed", ticket.attempt)
            for state in group.live:
                self._move(state, f"the KV hand-off failed: {type(exc).__name__}: {exc}")
        finally:
            src.exports.discard(ticket.attempt)
            try:
                if not group.decoding:
                    await self.transport.discard(ticket, src)
                if ticket.stream_of:
                    await self._close_stream(ticket.stream_of, imported=group.decoding)
            finally:
                self.num_handoffs_in_flight -= 1

    async def _rank_died(self, pool: Pool, rank: RankHandle, why: str) -> None:
        if rank.state == DEAD:
            return  # already handled (scaled down, or declared dead by its pool)
        self.num_rank_failures += 1
        log.error("%s died: %s", rank.name, why)
        rank.state = DEAD
        rank.error = why
        try:  # if only its replies failed, make sure it is gone before the group re-forms
            ray.kill(rank.actor, no_restart=True)
        except Exception:
            pass
        cause = f"{rank.name} died ({why.splitlines()[0][:200]})"
        for key in list(rank.inflight):
            state = self.tracker.by_attempt(key)
            rank.inflight.discard(key)
            if state is None or state.finished:
                continue
            if state.stage == HANDOFF:
                continue  # the delivery task sees the failure and moves it itself
            self._move(state, cause)
        await pool.remove_dead(rank)

    # -- state -----------------------------------------------------------------------

    def cluster_state(self) -> dict:
        """GetClusterState's content; each pool's ``ranks`` are its ``RankHandle``s as
        they are now, which server.py's ``rank_message`` turns into the proto."""
        pools = [{"name": pool.name, "target_replicas": pool.target, "ranks": list(pool.ranks),
                  "group_generation": pool.generation} for pool in self.pools.values()]
        return {"mode": self.config.mode, "model": self.config.model_dir, "pools": pools,
                "num_inflight": len(self.tracker), "max_queue_depth": self.config.max_queue_depth,
                "kv_transport": self.transport.name, "planner": self.planner_state()}

    def planner_state(self) -> dict:
        """The planner's settings, its last decisions and notes, and the recent latency
        percentiles it judges (shown with or without autoscale)."""
        c, now = self.config, time.monotonic()
        recent = {f"{name}_p{q}_ms": 1e3 * (window.percentile(q, now) or 0.0)
                  for name, window in (("ttft", self.latencies.ttft), ("itl", self.latencies.itl))
                  for q in (50, 90, 99)}
        state = {"enabled": self.planner is not None, "slo_ttft_ms": c.slo_ttft_ms,
                 "slo_itl_ms": c.slo_itl_ms, "slo_percentile": c.slo_percentile,
                 "min_prefill": c.min_prefill, "max_prefill": c.max_prefill,
                 "min_decode": c.min_decode, "max_decode": c.max_decode,
                 "window_s": c.planner_window_s, **recent,
                 "decisions": [], "notes": {}}
        if self.planner is not None:
            state.update(self.planner.state())
        return state

    async def timeline(self, since: float = 0.0) -> list[dict]:
        """Every live rank's step records that ended after unix time `since`."""
        ranks = [r for p in self.pools.values() for r in p.ranks if r.state != DEAD]
        results = await asyncio.gather(
            *(asyncio.wait_for(r.actor.timeline_records.remote(since),
                               self.config.rank_call_timeout_s) for r in ranks),
            return_exceptions=True)
        return [rec for res in results if isinstance(res, list) for rec in res]

    async def refresh_stats(self) -> None:
        """Fresh stats from every live rank; a rank that does not answer within
        `rank_call_timeout_s` keeps the stats of its last poll."""
        ranks = [r for p in self.pools.values() for r in p.ranks if r.state != DEAD]
        results = await asyncio.gather(
            *(asyncio.wait_for(r.actor.stats.remote(), self.config.rank_call_timeout_s)
              for r in ranks), return_exceptions=True)
        for r, st in zip(ranks, results, strict=True):
            if isinstance(st, EngineStats):
                r.stats = st

    async def scale(self, pool_name: str, replicas: int) -> int:
        """Resize a pool: a pool operation that completes or rolls back on its own,
        whatever the caller does (the caller only waits for it). A second one while one
        runs is refused (FAILED_PRECONDITION)."""
        pool = self.pools.get(pool_name)
        if pool is None:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pool must be one of {sorted(self.pools)}, got {pool_name!r}")
        limit = self.config.max_replicas
        if not 1 <= replicas <= limit:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"replicas must be in [1, {limit}] (max_replicas), got {replicas}")
        if pool.scaling is not None and not pool.scaling.done():
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the {pool_name} pool is already being resized to "
                               f"{pool.target} ranks; retry when it is done")
        pool.scaling = self.spawn(pool.scale(replicas))
        return await asyncio.shield(pool.scaling)


def _ranks_of(state: RequestState) -> list[RankHandle]:
    """The distinct ranks a request's current attempt is on."""
    ranks = [r for r in (state.prefill_rank, state.decode_rank) if r is not None]
    return ranks[:1] if len(ranks) == 2 and ranks[0] is ranks[1] else ranks
