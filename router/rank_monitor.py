"""Every rank's health, watched through its reports.

1. Each rank is long-polled by a task of its own (``poll``): one Ray reply carries the
   step reports since the last one (handed to ``ReportRouter.on_step``) and its stats.
2. A poll that fails or gets no reply within ``rank_unresponsive_s``, or a rank that
   says it gave up (``fatal``), makes the rank dead: it is killed, its requests move,
   and its pool forgets it (``rank_died``).
3. A rank whose engine loop failed has its pool's group re-formed (healed), once per
   group generation, up to ``max_group_heals`` times in a row; then it is dead.
4. A rank its pool removed (scale-down) hands its requests back to be moved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import ray

from pdserve.rank.messages import PollReply
from pdserve.router.config import RouterConfig
from pdserve.router.pools import Pool
from pdserve.router.rank_handle import DEAD, RankHandle
from pdserve.router.report_routing import ReportRouter
from pdserve.router.request_flow import RequestFlow
from pdserve.router.requests import HANDOFF, RequestTracker

log = logging.getLogger(__name__)


class RankMonitor:
    """Polls every rank, declares dead ones, heals failed groups."""

    def __init__(self, config: RouterConfig, tracker: RequestTracker, flow: RequestFlow,
                 reports: ReportRouter, *,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
                 stopping: Callable[[], bool]) -> None:
        self.config = config
        self.tracker = tracker
        self.flow = flow
        self.reports = reports
        self.spawn = spawn
        self.stopping = stopping
        self.num_rank_failures = 0

    def start_polling(self, pool: Pool, rank: RankHandle) -> None:
        rank.poll_task = self.spawn(self.poll(pool, rank))

    async def poll(self, pool: Pool, rank: RankHandle) -> None:
        while not self.stopping() and rank.state != DEAD:
            try:
                reply = await asyncio.wait_for(
                    rank.actor.poll.remote(self.config.poll_timeout_s),
                    self.config.rank_unresponsive_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    exc = TimeoutError(
                        f"no reply to a poll for {self.config.rank_unresponsive_s:g}s")
                if rank.state != DEAD:
                    await self.rank_died(pool, rank, f"{type(exc).__name__}: {exc}")
                return
            rank.stats = reply.stats
            for step in reply.steps:
                self.reports.on_step(pool, rank, step)
            if reply.fatal:
                await self.rank_died(pool, rank, f"it gave up: {reply.loop_error}")
                return
            if not await self._check_loop(pool, rank, reply):
                return

    async def _check_loop(self, pool: Pool, rank: RankHandle, reply: PollReply) -> bool:
        """Heal the pool's group if the rank's loop failed; False once the rank is dead."""
        if reply.loop_error and reply.generation == pool.generation \
                and not pool.lock.locked() and rank.failed_generation != reply.generation:
            # Counted once per group generation: a loop that failed reports it on
            # every poll until the group re-forms.
            rank.error = reply.loop_error
            rank.failed_generation = reply.generation
            rank.num_loop_failures += 1
            if rank.num_loop_failures > self.config.max_group_heals:
                await self.rank_died(pool, rank, f"its engine loop failed "
                                     f"{rank.num_loop_failures} times; last: {reply.loop_error}")
                return False
            log.warning("%s: engine loop failed (%s); re-forming the group",
                        rank.name, reply.loop_error)
            self.spawn(pool.heal(reply.generation))
        elif reply.steps and not reply.loop_error:
            rank.num_loop_failures = 0
        return True

    def requests_left_on(self, pool: Pool, rank: RankHandle, why: str) -> None:
        for key in list(rank.inflight):
            rank.inflight.discard(key)
            state = self.tracker.by_attempt(key)
            if state is not None and not state.finished and state.stage != HANDOFF:
                self.flow.move(state, why)

    async def rank_died(self, pool: Pool, rank: RankHandle, why: str) -> None:
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
            self.flow.move(state, cause)
        await pool.remove_dead(rank, f"({why.splitlines()[0][:200]})")
