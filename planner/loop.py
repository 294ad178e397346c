"""The planner's loop in the router process: look, decide, resize, report.

Every ``planner_interval_s`` it refreshes the ranks' stats, takes a snapshot
(signals.py), asks the policy (policy.py) and applies each decision through
``RouterService.scale``, the very resize `pdserve scale` (ScalePool) runs, so a
planner's resize is bounded, drains and rolls back exactly like a person's. A resize
runs in a task of its own with a deadline, so the loop keeps looking (and reporting)
while a pool grows; a person resizing a pool meanwhile is seen as a resize in flight.

It never takes the router down: a look that raises is logged and the next one comes;
every decision is logged with its reason, counted in the metrics and kept (the last
``MAX_RECORDS``) for GetClusterState and `pdserve status`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from pdserve.planner.host import PlannerHost, RankStartError
from pdserve.planner.policy import Decision, Planner, PolicyConfig
from pdserve.planner.signals import collect_signals

log = logging.getLogger(__name__)

MAX_RECORDS = 32
APPLYING, APPLIED, FAILED, TIMED_OUT = "applying", "applied", "failed", "timed out"


@dataclass
class DecisionRecord:
    at: float          # unix time it was made
    decision: Decision
    outcome: str = APPLYING
    error: str = ""

    def as_dict(self) -> dict:
        d = self.decision
        return {"at": self.at, "pool": d.pool, "from_replicas": d.from_replicas,
                "to_replicas": d.to_replicas, "reason": d.reason, "outcome": self.outcome,
                "error": self.error}


class PlannerLoop:
    def __init__(self, service: PlannerHost) -> None:
        self.service = service
        c = service.config
        self.interval_s = c.planner_interval_s
        self.policy = Planner(PolicyConfig.from_router_config(c))
        # A resize the planner asked for gives up waiting after this long (the pool
        # operation itself goes on and completes or rolls back; it is seen as in flight).
        self.scale_deadline_s = (c.rank_start_timeout_s + c.drain_timeout_s
                                 + 4 * c.group_timeout_s)
        self.records: deque[DecisionRecord] = deque(maxlen=MAX_RECORDS)
        self.num_looks = 0
        self.num_failed_looks = 0
        self._applying: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        log.info("planner on: TTFT objective %g ms, ITL objective %g ms (p%g), prefill "
                 "%s, decode %s", self.service.config.slo_ttft_ms,
                 self.service.config.slo_itl_ms, self.policy.config.percentile,
                 self.policy.config.bounds["prefill"], self.policy.config.bounds["decode"])
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.look()
            except asyncio.CancelledError:
                raise
            except Exception:  # the router serves on; the next look tries again
                self.num_failed_looks += 1
                log.exception("planner: a look failed")

    async def look(self) -> list[Decision]:
        """One look: refresh, snapshot, decide, start applying. Returns the decisions."""
        await self.service.refresh_stats()  # each rank's call is bounded
        busy = frozenset(p for p, t in self._applying.items() if not t.done())
        signals = collect_signals(self.service, time.monotonic(), busy)
        decisions = self.policy.decide(signals)
        self.num_looks += 1
        for decision in decisions:
            record = DecisionRecord(time.time(), decision)
            self.records.append(record)
            log.info("planner: %s %d -> %d: %s", decision.pool, decision.from_replicas,
                     decision.to_replicas, decision.reason)
            self._applying[decision.pool] = self.service.spawn(self._apply(record))
        return decisions

    async def _apply(self, record: DecisionRecord) -> None:
        d = record.decision
        try:
            await asyncio.wait_for(self.service.scale(d.pool, d.to_replicas),
                                   self.scale_deadline_s)
        except asyncio.TimeoutError:
            record.outcome = TIMED_OUT
            record.error = (f"not done after {self.scale_deadline_s:g}s; the resize goes on "
                            "and completes or rolls back by itself")
        except Exception as exc:
            record.outcome, record.error = FAILED, f"{type(exc).__name__}: {exc}"
            self.policy.failed(d, time.monotonic(), record.error,
                               could_not_start=isinstance(exc, RankStartError))
        else:
            record.outcome = APPLIED
        self.service.metrics.planner_decided(d.pool, d.direction, record.outcome)
        if record.outcome == APPLIED:
            log.info("planner: %s is at %d ranks", d.pool, d.to_replicas)
        else:
            log.warning("planner: %s %d -> %d %s: %s", d.pool, d.from_replicas,
                        d.to_replicas, record.outcome, record.error)

    def state(self) -> dict:
        """The planner's part of GetClusterState."""
        now = time.monotonic()
        return {"decisions": [r.as_dict() for r in self.records],
                "notes": {pool: self.policy.held(pool, now) or note
                          for pool, note in self.policy.notes.items()},
                "num_looks": self.num_looks, "num_failed_looks": self.num_failed_looks}
