"""A request's way through the router: admitted, dispatched to an entry rank, moved
when its attempt is lost, finished or aborted exactly once.

1. ``admit``: registered with the tracker (its label checked), one state per choice;
   an ``Abort`` that named its label before it arrived ends it at once.
2. ``dispatch``: the least-loaded (or cache-aware) entry rank starts its next attempt,
   with the choices that share its prefill (n > 1); a rank that dies or hangs on the
   way is left for the next one, up to ``max_attempts``.
3. ``move``: an attempt lost anywhere (a rank died, a step failed, a report was lost,
   no progress for ``request_stall_timeout_s``) starts again elsewhere from the
   request's history; the old attempt is aborted where it can be.
4. ``finish`` / ``end_now``: the request ends with its finish reason, leaves its ranks
   and its KV stream, and its label is free again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from pdserve.rank.messages import ForkSpec
from pdserve.router.config import RouterConfig
from pdserve.router.kv_stream import KVStreams
from pdserve.router.placement import begin_on, computes_on, leave, ranks_of
from pdserve.router.pools import Pool
from pdserve.router.rank_handle import DEAD, RankHandle
from pdserve.router.requests import DECODE, HANDOFF, PREFILL, QUEUED, RequestState, RequestTracker
from pdserve.router.routing import PromptBlocks
from pdserve.router.validation import PreparedRequest

log = logging.getLogger(__name__)


class RequestFlow:
    """Admission, dispatch, moves and ends of the router's requests."""

    def __init__(self, config: RouterConfig, tracker: RequestTracker, pools: Mapping[str, Pool],
                 kv_streams: KVStreams, *,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
                 abort_on: Callable[[RankHandle, str], Coroutine[Any, Any, None]],
                 stopping: Callable[[], bool]) -> None:
        self.config = config
        self.tracker = tracker
        self.pools = pools
        self.kv_streams = kv_streams
        self.spawn = spawn
        self.abort_on = abort_on
        self.stopping = stopping
        self.disaggregated = config.mode == "disaggregated"
        # the configured one until the ranks (they must agree) say theirs at start
        self.block_size = config.pools()[0].engine.block_size
        self.max_model_len = 0  # the ranks' smallest, set at start
        self.num_moves = 0

    @property
    def entry_pool(self) -> Pool:
        return self.pools["prefill" if self.disaggregated else "normal"]

    # -- admission and dispatch ------------------------------------------------------

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
                self.finish(state, "abort", "aborted by the client before the request arrived")
            return states
        self.spawn(self.dispatch(lead))
        return states

    async def dispatch(self, state: RequestState) -> None:
        """Start the request's next attempt on the least-loaded entry rank, with the
        choices that join it (n > 1: their first attempt shares its prefill)."""
        state.joins_lead = False  # it goes now, on its own or leading the others
        try:
            while not (state.finished or state.aborted):
                if self._cannot_go_on(state):
                    return
                prompt = self._prompt_blocks(state)
                rank = await self._wait_for_rank(state, prompt)
                if rank is None:
                    return
                if await self._start_on(rank, state, prompt):
                    return
        finally:
            for s in state.siblings:  # the lead ended before them: each goes on its own
                if s.joins_lead and s.stage == QUEUED and not (s.finished or s.aborted):
                    s.joins_lead = False
                    self.spawn(self.dispatch(s))

    def _cannot_go_on(self, state: RequestState) -> bool:
        """Finish the request if no attempt can go on; True when it did."""
        history = len(state.request.prompt_token_ids) + len(state.tokens)
        if state.tokens_left <= 0 or history >= self.max_model_len:
            # every token arrived (only the finish was lost), or the history fills
            # the model's length: the engine would have stopped here too
            self.finish(state, "length")
            return True
        if state.attempt >= self.config.max_attempts:
            self.finish(state, "error", f"no {self.entry_pool.name} rank could finish the "
                        f"request after {state.attempt} attempts"
                        + (f" (last: {state.error_hint})" if state.error_hint else ""))
            return True
        return False

    async def _wait_for_rank(self, state: RequestState,
                             prompt: PromptBlocks) -> RankHandle | None:
        """The entry rank for the next attempt (None: the request ended meanwhile, or
        none came within ``rank_wait_s``: then it finished with an error)."""
        pool = self.entry_pool
        rank = await pool.wait_for_rank(self.config.rank_wait_s,
                                        lambda: state.finished or state.aborted, prompt)
        if state.finished or state.aborted:
            return None
        if rank is None:
            self.finish(state, "error", f"no {pool.name} rank is available")
        return rank

    def _prompt_blocks(self, state: RequestState) -> PromptBlocks:
        computed = state.request.prompt_token_ids + state.tokens
        if self.config.routing == "cache_aware":  # hashed only to be matched
            return PromptBlocks.of(computed, self.block_size)
        return PromptBlocks(len(computed), self.block_size, [])

    async def _start_on(self, rank: RankHandle, state: RequestState,
                        prompt: PromptBlocks) -> bool:
        """Send the attempt (and its joining choices) to ``rank``; False when the call
        failed and the next rank should be tried."""
        forks = [s for s in state.siblings if s.joins_lead and not (s.finished or s.aborted)]
        add = begin_on(rank, state, self.disaggregated)
        add.forks = [ForkSpec(begin_on(rank, s, self.disaggregated).attempt, s.request.sampling)
                     for s in forks]
        add.stream_kv = self.disaggregated and self.config.kv_streaming
        # what the rank computes: the prompt past the prefix its cache holds
        computes_on(rank, state, len(add.prompt_token_ids) - prompt.cached_tokens, prompt.hashes)
        for s in (state, *forks):  # what a decode rank may already hold of it
            s.prompt_hashes = prompt.hashes
        started = [(state, add.attempt), *((s, s.attempt_key) for s in forks)]
        try:
            result = await asyncio.wait_for(rank.actor.add_request.remote(add),
                                            self.config.rank_call_timeout_s)
        except Exception as exc:  # the rank died or hung on the way: try another
            if state.attempt_key != add.attempt or add.attempt not in rank.inflight:
                return True  # the rank's death got there first and has already moved them
            await self._not_started(rank, started, exc)
            return False
        self._prepare_grammar(state)
        for s, key in started:
            if s.attempt_key != key:
                continue  # moved meanwhile (its rank died): it goes on elsewhere
            if not result.ok:
                leave(rank, s)
                self.finish(s, "error", f"{rank.pool} rank refused the request: {result.error}")
            elif s.aborted or s.finished:  # ended while add_request was on its way
                await self.abort_on(rank, key)
        return True

    def _prepare_grammar(self, state: RequestState) -> None:
        """Disaggregated: every decode rank starts compiling a guided request's grammar
        while its prompt computes, so the import that follows finds it ready. A hint:
        nothing waits for it (a rank that misses it compiles on import)."""
        guide = state.request.sampling.guide
        if guide is None or not self.disaggregated:
            return
        for rank in self.pools["decode"].ready():
            rank.actor.prepare_grammar.remote(guide)

    async def _not_started(self, rank: RankHandle, started: list[tuple[RequestState, str]],
                           exc: Exception) -> None:
        for s, key in started:
            if s.attempt_key == key:
                leave(rank, s)
                s.stage = QUEUED  # no attempt runs while it waits for the next rank
                s.error_hint = f"add_request on {rank.name}: {type(exc).__name__}"
        log.warning("add_request on %s failed: %s", rank.name, exc)
        for _, key in started:
            await self.abort_on(rank, key)

    # -- moves and ends --------------------------------------------------------------

    def move(self, state: RequestState, why: str) -> None:
        """Start the request again elsewhere from its history (prompt + tokens already
        streamed), leaving its current attempt wherever it is (aborted if reachable)."""
        if state.finished or state.aborted or state.stage == QUEUED:
            return  # ended, or already moving (its next attempt is not dispatched yet)
        old = state.attempt_key
        state.early_reports = []  # the attempt's, and it goes
        for rank in ranks_of(state):
            if old in rank.inflight and rank.state != DEAD:
                self.spawn(self.abort_on(rank, old))
        if state.stage != HANDOFF:  # in a hand-off, its delivery task closes the stream
            self.kv_streams.drop(old)
        leave(state.prefill_rank, state)
        leave(state.decode_rank, state)
        state.prefill_rank = state.decode_rank = None
        state.stage = QUEUED
        state.handoff_group = None
        state.num_moves += 1
        state.error_hint = why
        self.num_moves += 1
        log.info("moving request %s (attempt %d): %s", state.label, state.attempt, why)
        self.spawn(self.dispatch(state))

    def finish(self, state: RequestState, reason: str, error: str | None = None,
               token_ids: list[int] | None = None, logprobs: list | None = None) -> None:
        if state.stage != HANDOFF:
            self.kv_streams.drop(state.attempt_key)
        state.finish(reason, error, token_ids, logprobs)
        leave(state.prefill_rank, state)
        leave(state.decode_rank, state)

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

    def end_now(self, state: RequestState, reason: str,
                finish_reason: str = "abort") -> list[asyncio.Task]:
        """End a request wherever it is (client gone, deadline, Abort), finished before
        this returns; the aborts on its ranks run in the returned tasks.
        ``finish_reason`` "stop": the router itself found the end (a stop string), so
        ``reason`` is no error."""
        if state.finished:
            return []
        state.aborted = True
        attempt = state.attempt_key
        ranks = ranks_of(state)
        if state.stage == HANDOFF and any(not (s is state or s.finished or s.aborted)
                                          for s in state.handoff_group or ()):
            # its payload still carries choices that go on: the delivery task ends this
            # one on the decode rank once the payload is there (the prefill rank, which
            # holds the payload under the lead's attempt, must keep it)
            ranks = [r for r in ranks if r is not state.prefill_rank]
        self.finish(state, finish_reason, reason if finish_reason != "stop" else None)
        # HANDOFF: the delivery task sees `aborted` and cleans up after itself.
        return [self.spawn(self.abort_on(r, attempt)) for r in ranks if r.state != DEAD]

    async def watch_stalls(self) -> None:
        """Move attempts that made no progress for request_stall_timeout_s: the last
        bound, for a report lost with nothing after it to reveal the gap."""
        limit = self.config.request_stall_timeout_s
        while not self.stopping():
            await asyncio.sleep(min(1.0, limit / 10))
            now = time.monotonic()
            for state in self.tracker.states():
                if state.stage in (PREFILL, DECODE) and not state.aborted \
                        and now - state.progress_at > limit:
                    self.move(state, f"no progress for {limit:g}s")
