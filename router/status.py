"""What the router shows of itself: the cluster's state, the planner's, the ranks'
step timelines and fresh stats (GetClusterState, /status, ``pdserve status``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from pdserve.rank.messages import EngineStats
from pdserve.router.pools import Pool
from pdserve.router.rank_handle import DEAD, RankHandle


def cluster_state(service: Any) -> dict:
    """GetClusterState's content; each pool's ``ranks`` are its ``RankHandle``s as they
    are now, which server.py's ``rank_message`` turns into the proto."""
    pools = [{"name": pool.name, "target_replicas": pool.target, "ranks": list(pool.ranks),
              "group_generation": pool.generation} for pool in service.pools.values()]
    config = service.config
    return {"mode": config.mode, "model": config.model_dir, "pools": pools,
            "num_inflight": len(service.tracker), "max_queue_depth": config.max_queue_depth,
            "kv_transport": service.transport.name, "planner": planner_state(service)}


def planner_state(service: Any) -> dict:
    """The planner's settings, its last decisions and notes, and the recent latency
    percentiles it judges (shown with or without autoscale)."""
    c, now, latencies = service.config, time.monotonic(), service.latencies
    recent = {f"{name}_p{q}_ms": 1e3 * (window.percentile(q, now) or 0.0)
              for name, window in (("ttft", latencies.ttft), ("itl", latencies.itl))
              for q in (50, 90, 99)}
    state = {"enabled": service.planner is not None, "slo_ttft_ms": c.slo_ttft_ms,
             "slo_itl_ms": c.slo_itl_ms, "slo_percentile": c.slo_percentile,
             "min_prefill": c.min_prefill, "max_prefill": c.max_prefill,
             "min_decode": c.min_decode, "max_decode": c.max_decode,
             "window_s": c.planner_window_s, **recent,
             "decisions": [], "notes": {}}
    if service.planner is not None:
        state.update(service.planner.state())
    return state


def live_ranks(pools: Mapping[str, Pool]) -> list[RankHandle]:
    return [r for p in pools.values() for r in p.ranks if r.state != DEAD]


async def timeline(pools: Mapping[str, Pool], since: float, timeout_s: float) -> list[dict]:
    """Every live rank's step records that ended after unix time `since` (a rank that
    does not answer within ``timeout_s`` is left out)."""
    results = await asyncio.gather(
        *(asyncio.wait_for(r.actor.timeline_records.remote(since), timeout_s)
          for r in live_ranks(pools)), return_exceptions=True)
    return [rec for res in results if isinstance(res, list) for rec in res]


async def refresh_stats(pools: Mapping[str, Pool], timeout_s: float) -> None:
    """Fresh stats from every live rank; a rank that does not answer within
    ``timeout_s`` keeps the stats of its last poll."""
    ranks = live_ranks(pools)
    results = await asyncio.gather(
        *(asyncio.wait_for(r.actor.stats.remote(), timeout_s) for r in ranks),
        return_exceptions=True)
    for r, st in zip(ranks, results, strict=True):
        if isinstance(st, EngineStats):
            r.stats = st
