"""The planner's loop against a stand-in router (no Ray): decisions go through
``service.scale`` and their outcomes are kept and counted; a scale-up whose ranks
could not start holds the pool; a look that raises or a resize that hangs never stops
the loop. Time here is asyncio's, in bounded waits; the decisions themselves are
tested on traces (test_policy_traces.py)."""

from __future__ import annotations

import asyncio
import dataclasses

from pdserve.planner.host import RankStartError
from pdserve.planner.latency_window import RecentLatencies
from pdserve.planner.loop import PlannerLoop
from pdserve.rank.messages import EngineStats
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.rank_handle import RankHandle

DEADLINE_S = 10.0


class StandInPool:
    def __init__(self, name: str, n: int) -> None:
        self.name, self.target = name, n
        self.changing = False  # a re-form or resize under way
        self.ranks = [RankHandle(name, None, uid=i + 1, state="ready", ready_at=-1e9)
                      for i in range(n)]


class StandInService:
    """What PlannerLoop and collect_signals use of a RouterService."""

    def __init__(self, config: RouterConfig, scale_error: BaseException | None = None,
                 scale_hangs: bool = False) -> None:
        self.config = config
        self.pools = {"prefill": StandInPool("prefill", 3), "decode": StandInPool("decode", 1)}
        self.tracker: list = []  # len() = requests in flight: none, the router is idle
        self.latencies = RecentLatencies(config.planner_window_s)
        self.metrics = RouterMetrics()
        self.scale_calls: list[tuple[str, int]] = []
        self.scale_error, self.scale_hangs = scale_error, scale_hangs
        self.refresh_error: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def refresh_stats(self) -> None:
        if self.refresh_error is not None:
            raise self.refresh_error
        for pool in self.pools.values():
            for r in pool.ranks:
                r.stats = EngineStats()

    async def scale(self, pool_name: str, replicas: int) -> int:
        self.scale_calls.append((pool_name, replicas))
        if self.scale_hangs:
            await asyncio.sleep(3600)
        if self.scale_error is not None:
            raise self.scale_error
        pool = self.pools[pool_name]
        previous, pool.target = pool.target, replicas
        pool.ranks = pool.ranks[:replicas]
        return previous


def _config(**kw) -> RouterConfig:
    fields = dict(model_dir="", autoscale=True, planner_interval_s=0.01,
                  planner_cooldown_s=0.05, planner_warmup_s=0.0)
    fields.update(kw)
    return RouterConfig(**fields)


async def _until(condition, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _counted(service: StandInService, pool: str, direction: str, outcome: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "pdserve_planner_decisions_total",
        {"pool": pool, "direction": direction, "outcome": outcome})
    return value or 0.0


def test_an_idle_router_is_brought_to_the_minima_through_service_scale():
    async def run():
        svc = StandInService(_config())
        loop = PlannerLoop(svc)
        task = svc.spawn(loop.run())
        await _until(lambda: loop.records and loop.records[-1].outcome == "applied",
                     "the decision applied")
        task.cancel()
        return svc, loop

    svc, loop = asyncio.run(run())
    assert svc.scale_calls == [("prefill", 1)]
    (record,) = loop.records
    assert record.decision.reason.startswith("idle for")
    state = loop.state()
    assert state["decisions"][0]["pool"] == "prefill"
    assert state["decisions"][0]["from_replicas"] == 3
    assert state["decisions"][0]["to_replicas"] == 1
    assert state["decisions"][0]["outcome"] == "applied"
    assert _counted(svc, "prefill", "down", "applied") == 1


def test_new_ranks_that_cannot_start_hold_the_pool_with_the_reason():
    async def run():
        svc = StandInService(_config(min_prefill=4, max_prefill=4),
                             scale_error=RankStartError("1 of 1 new prefill ranks failed to "
                                                        "start: TimeoutError: not ready"))
        loop = PlannerLoop(svc)
        task = svc.spawn(loop.run())
        await _until(lambda: loop.records and loop.records[-1].outcome == "failed",
                     "the failure recorded")
        looks = loop.num_looks
        await _until(lambda: loop.num_looks >= looks + 20, "20 more looks")
        task.cancel()
        return svc, loop

    svc, loop = asyncio.run(run())
    assert svc.scale_calls == [("prefill", 4)]  # one try: no retry within the back-off
    assert loop.records[0].error.startswith("RankStartError: 1 of 1 new prefill ranks")
    notes = loop.state()["notes"]
    assert notes["prefill"].startswith("held at 3: 4 ranks could not start")
    assert _counted(svc, "prefill", "up", "failed") == 1
    assert svc.pools["prefill"].target == 3


def test_a_look_that_raises_is_logged_and_the_loop_goes_on(caplog):
    async def run():
        svc = StandInService(_config())
        svc.refresh_error = RuntimeError("a rank's stats could not be read")
        loop = PlannerLoop(svc)
        task = svc.spawn(loop.run())
        await _until(lambda: loop.num_failed_looks >= 3, "three failed looks")
        svc.refresh_error = None
        await _until(lambda: loop.records, "a decision once looks work again")
        task.cancel()
        return loop, task

    loop, task = asyncio.run(run())
    assert task.cancelled()  # it ran until stopped, it did not end on the errors
    assert "planner: a look failed" in caplog.text


def test_a_resize_past_its_deadline_is_recorded_and_the_loop_keeps_looking():
    async def run():
        svc = StandInService(_config(), scale_hangs=True)
        loop = PlannerLoop(svc)
        loop.scale_deadline_s = 0.1
        task = svc.spawn(loop.run())
        await _until(lambda: loop.records and loop.records[-1].outcome == "timed out",
                     "the deadline")
        looks = loop.num_looks
        await _until(lambda: loop.num_looks > looks + 3, "more looks")
        task.cancel()
        for t in list(svc._tasks):
            t.cancel()
        return loop

    loop = asyncio.run(run())
    assert "the resize goes on" in loop.records[0].error
    assert dataclasses.asdict(loop.records[0].decision)["pool"] == "prefill"
