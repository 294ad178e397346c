"""What the planner needs of the process that hosts it: the router's public side.

The router runs the planner on its own event loop and hands it itself
(``PlannerLoop(service)``); the planner reads and drives it only through what
``PlannerHost`` lists, and imports none of the router's modules, so the dependency
points one way (router -> planner; checked by the import contracts in pyproject.toml).
``RankStartError`` is declared here, by the side that acts on it: the router's pools
raise it when a resize's new ranks could not start, and the planner then holds the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sized
from typing import Any, Protocol

from pdserve.planner.latency_window import RecentLatencies


class RankStartError(RuntimeError):
    """New ranks did not start in time (Ray could not place them, or they failed to
    load): the resize that asked for them rolled back. The planner backs off on it."""


class PlannerMetrics(Protocol):
    def planner_decided(self, pool: str, direction: str, outcome: str) -> None: ...


class PlannerHost(Protocol):
    """The router as the planner sees it (``RouterService`` is one)."""

    # RouterConfig: the planner_* and slo_* settings, the pools' bounds and the resize
    # timeouts (PolicyConfig.from_router_config, PlannerLoop).
    config: Any
    # Pool name -> pool: ``target``, ``changing`` (a re-form or resize under way)
    # and ``ranks`` (each: ``uid``, ``state``, ``ready_at``, ``stats``,
    # ``outstanding_tokens``), read by signals.collect_signals.
    pools: Mapping[str, Any]
    tracker: Sized                # the requests the router holds
    latencies: RecentLatencies    # the router's recent TTFT and inter-token samples
    metrics: PlannerMetrics

    async def refresh_stats(self) -> None:
        """Poll every rank's stats (each call bounded)."""

    async def scale(self, pool_name: str, replicas: int) -> int:
        """The bounded resize `pdserve scale` runs; raises RankStartError when the new
        ranks could not start (the resize rolled back)."""

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` as one of the host's tasks (kept until done, cancelled at stop)."""
