"""What the planner reads: one typed, immutable snapshot of the router's own state.

``collect_signals`` copies what the policy needs out of a running ``RouterService``
(its pools and ranks, the stats each rank sent with its last poll, the router's
recent TTFT and inter-token samples, latency_window.py) at one instant. The
policy (policy.py) then works on the snapshot alone, so it can be tested on recorded
traces of snapshots without a router, a clock or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.planner.latency_window import LatencySample

if TYPE_CHECKING:
    from pdserve.planner.host import PlannerHost


@dataclass(frozen=True)
class RankSignals:
    uid: int                    # RankHandle.uid: unique within its pool
    state: str                  # "starting", "ready", "draining", "dead"
    ready_at: float | None      # when it first became ready (None: not yet)
    num_waiting: int = 0        # engine queue: prompts (or payloads) not yet running
    num_running: int = 0
    num_prompted: int = 0       # decode: imported, waiting for their first decode step
    waiting_prompt_tokens: int = 0  # prompt tokens sent here and not yet prefilled
    kv_usage: float = 0.0
    num_preemptions: int = 0    # counter since the rank started

    def warm(self, at: float, warmup_s: float) -> bool:
        """Ready (or draining) and past its warm-up at time ``at``."""
        return (self.state in ("ready", "draining") and self.ready_at is not None
                and at - self.ready_at >= warmup_s)


@dataclass(frozen=True)
class PoolSignals:
    name: str
    target: int                 # the size the pool is at or being resized to
    resizing: bool = False      # a resize or re-form is in flight: its new ranks are
    #                             pending capacity (started, or waiting for Ray)
    ranks: tuple[RankSignals, ...] = ()

    @property
    def ready(self) -> list[RankSignals]:
        return [r for r in self.ranks if r.state == "ready"]

    def rank(self, uid: int) -> RankSignals | None:
        for r in self.ranks:
            if r.uid == uid:
                return r
        return None

    @property
    def queues_empty(self) -> bool:
        return all(r.num_waiting == 0 and r.num_prompted == 0 and r.waiting_prompt_tokens == 0
                   for r in self.ranks if r.state != "dead")

    @property
    def waiting_prompt_tokens_per_rank(self) -> float:
        ready = self.ready
        return sum(r.waiting_prompt_tokens for r in ready) / len(ready) if ready else 0.0


@dataclass(frozen=True)
class Signals:
    at: float                   # time.monotonic() of the snapshot: the policy's "now"
    pools: dict[str, PoolSignals]
    num_inflight: int = 0       # requests the router holds (queued, running, streaming)
    ttft: tuple[LatencySample, ...] = ()  # recent first-token latencies, oldest first
    itl: tuple[LatencySample, ...] = ()   # recent inter-token gaps, oldest first


def collect_signals(service: PlannerHost, now: float, busy_pools: frozenset[str] = frozenset()
                    ) -> Signals:
    """A snapshot of ``service`` (the router: a PlannerHost) at ``now`` (time.monotonic()).

    ``busy_pools``: pools the planner itself is resizing (its call may not have reached
    the pool yet): they count as resizing too."""
    pools = {}
    for name, pool in service.pools.items():
        resizing = name in busy_pools or pool.changing
        ranks = tuple(RankSignals(
            uid=r.uid, state=r.state, ready_at=r.ready_at,
            num_waiting=r.stats.num_waiting, num_running=r.stats.num_running,
            num_prompted=r.stats.num_prompted,
            waiting_prompt_tokens=r.outstanding_tokens if name in ("prefill", "normal") else 0,
            kv_usage=float(r.stats.kv_usage), num_preemptions=r.stats.num_preemptions)
            for r in pool.ranks)
        pools[name] = PoolSignals(name, pool.target, resizing, ranks)
    return Signals(at=now, pools=pools, num_inflight=len(service.tracker),
                   ttft=service.latencies.ttft.recent(now), itl=service.latencies.itl.recent(now))
