"""The planner's decisions on recorded signal traces: snapshots with explicit times, no
clock, no sleeps, no Ray. ``Trace`` plays a small cluster forward look by look: each
look every ready rank emits latency samples for the time since the last look (as the
router's window records them), and a decision is applied at once, its new ranks
ready from that look on (or failed, or left pending, where a test says so)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdserve.planner.latency_window import LatencySample
from pdserve.planner.policy import Decision, Planner, PolicyConfig
from pdserve.planner.signals import PoolSignals, RankSignals, Signals
from pdserve.router.config import RouterConfig

INTERVAL = 5.0  # seconds between looks
COOLDOWN = 30.0
WARMUP = 10.0
BACKOFF = 300.0


def policy_config(**overrides) -> PolicyConfig:
    fields = dict(model_dir="", autoscale=True, slo_ttft_ms=1000.0, slo_itl_ms=100.0,
                  min_prefill=1, max_prefill=3, min_decode=1, max_decode=3,
                  planner_cooldown_s=COOLDOWN, planner_warmup_s=WARMUP,
                  planner_window_s=60.0, planner_min_samples=5, planner_backoff_s=BACKOFF)
    fields.update(overrides)
    config = RouterConfig(**fields)
    config.validate()
    return PolicyConfig.from_router_config(config)


@dataclass
class FakeRank:
    uid: int
    ready_at: float | None
    state: str = "ready"
    stats: dict = field(default_factory=dict)


class Trace:
    """A cluster the planner looks at, one look per ``step``."""

    def __init__(self, prefill: int = 1, decode: int = 1, **config) -> None:
        self.planner = Planner(policy_config(**config))
        self.window_s = 60.0
        self.at = 0.0
        self.ranks = {"prefill": [FakeRank(i + 1, -100.0) for i in range(prefill)],
                      "decode": [FakeRank(i + 1, -100.0) for i in range(decode)]}
        self.next_uid = {"prefill": prefill + 1, "decode": decode + 1}
        self.resizing: set[str] = set()
        self.samples = {"ttft": [], "itl": []}
        self.decisions: list[tuple[float, Decision]] = []
        self.sizes: list[tuple[float, int, int]] = []
        # pool -> could_not_start: its scale-ups fail (True: no new rank could start)
        self.fail_growth: dict[str, bool] = {}

    def size(self, pool: str) -> int:
        return len([r for r in self.ranks[pool] if r.state != "dead"])

    def emit(self, kind: str, pool: str, seconds: float | dict[int, float], per_rank: int = 4):
        """``per_rank`` samples from every ranked (not starting) rank of ``pool`` over the
        time since the last look; ``seconds`` per rank uid when a dict."""
        for r in self.ranks[pool]:
            if r.state in ("starting", "dead"):
                continue
            value = seconds.get(r.uid) if isinstance(seconds, dict) else seconds
            if value is None:
                continue
            for k in range(per_rank):
                at = self.at - INTERVAL + (k + 1) * INTERVAL / per_rank
                self.samples[kind].append(LatencySample(at, value, pool, r.uid))

    def snapshot(self, inflight: int = 1) -> Signals:
        horizon = self.at - self.window_s
        for kind in self.samples:
            self.samples[kind] = [x for x in self.samples[kind] if x.at >= horizon]
        pools = {}
        for name, ranks in self.ranks.items():
            rs = tuple(RankSignals(r.uid, r.state, r.ready_at, **r.stats) for r in ranks
                       if r.state != "dead")
            target = len(rs)
            pools[name] = PoolSignals(name, target, name in self.resizing, rs)
        return Signals(self.at, pools, num_inflight=inflight,
                       ttft=tuple(self.samples["ttft"]), itl=tuple(self.samples["itl"]))

    def step(self, ttft: float | dict | None = None, itl: float | dict | None = None,
             inflight: int = 1) -> list[Decision]:
        """Advance one look: samples for the interval, a snapshot, the planner's
        decisions, applied."""
        self.at += INTERVAL
        if ttft is not None:
            self.emit("ttft", "prefill", ttft)
        if itl is not None:
            self.emit("itl", "decode", itl)
        decisions = self.planner.decide(self.snapshot(inflight))
        for d in decisions:
            self.decisions.append((self.at, d))
            self.apply(d)
        self.sizes.append((self.at, self.size("prefill"), self.size("decode")))
        return decisions

    def apply(self, d: Decision) -> None:
        assert d.from_replicas == self.size(d.pool), d
        if d.to_replicas > d.from_replicas and d.pool in self.fail_growth:
            placement = self.fail_growth[d.pool]
            self.planner.failed(d, self.at, "RankStartError: not ready within 180s"
                                if placement else "FAILED_PRECONDITION: already being resized",
                                could_not_start=placement)
            return
        ranks = self.ranks[d.pool]
        while self.size(d.pool) < d.to_replicas:
            ranks.append(FakeRank(self.next_uid[d.pool], self.at))
            self.next_uid[d.pool] += 1
        while self.size(d.pool) > d.to_replicas:
            [r for r in ranks if r.state != "dead"][-1].state = "dead"

    def run(self, looks: int, **step) -> None:
        for _ in range(looks):
            self.step(**step)

    def of(self, pool: str) -> list[tuple[float, Decision]]:
        return [(at, d) for at, d in self.decisions if d.pool == pool]


def test_a_ttft_breach_grows_prefill_and_leaves_decode():
    t = Trace()
    t.run(5, ttft=2.0, itl=0.02)  # the first look counts as a change: cooling down
    assert t.decisions == []
    t.run(3, ttft=2.0, itl=0.02)
    (at, d), = t.decisions
    assert (d.pool, d.from_replicas, d.to_replicas) == ("prefill", 1, 2)
    assert "TTFT p90 2000 ms > objective 1000 ms" in d.reason
    assert at == 35.0  # the first look at t=5 + the cooldown
    assert t.of("decode") == []


def test_an_itl_only_breach_grows_decode_and_not_prefill():
    t = Trace()
    t.run(60, ttft=0.7, itl=0.25)  # TTFT within its objective; ITL 2.5x over it
    assert t.of("prefill") == []
    ups = [d for _, d in t.of("decode")]
    assert [(d.from_replicas, d.to_replicas) for d in ups] == [(1, 2), (2, 3)]
    assert all("ITL p90 250 ms > objective 100 ms" in d.reason for d in ups)


def test_the_maxima_are_never_exceeded():
    t = Trace(max_prefill=2, max_decode=3)
    t.run(200, ttft=5.0, itl=1.0)  # every objective broken for 1000 s
    assert max(p for _, p, _ in t.sizes) == 2 and max(d for _, _, d in t.sizes) == 3
    assert t.size("prefill") == 2 and t.size("decode") == 3
    assert all(d.to_replicas > d.from_replicas for _, d in t.decisions)
    assert "at its maximum 2" in t.planner.notes["prefill"]


def test_an_oscillating_load_does_not_flap():
    """Load switches every 10 s between far over and far under the objectives: each pool
    changes at most once per cooldown, and never twice in a row in opposite directions
    faster than two cooldowns."""
    t = Trace(max_prefill=3, max_decode=3)
    for i in range(240):
        high = (i // 2) % 2 == 0
        t.step(ttft=3.0 if high else 0.05, itl=0.4 if high else 0.005)
    for pool in ("prefill", "decode"):
        times = [at for at, _ in t.of(pool)]
        assert all(b - a >= COOLDOWN for a, b in zip(times, times[1:], strict=False)), times
        assert len(times) <= 1200 / COOLDOWN


def test_hysteresis_keeps_a_size_that_meets_the_objective():
    """At 70% of each objective (under it, not well under it) nothing changes."""
    t = Trace(prefill=2, decode=2)
    t.run(120, ttft=0.7, itl=0.07)
    assert t.decisions == []
    # and well under it, with the queues empty, one rank goes per cooldown
    t.run(40, ttft=0.1, itl=0.01)
    downs = t.of("prefill") + t.of("decode")
    assert sorted((d.pool, d.from_replicas, d.to_replicas) for _, d in downs) == [
        ("decode", 2, 1), ("prefill", 2, 1)]
    assert all("< 50% of the objective" in d.reason for _, d in downs)


def test_samples_of_warming_ranks_are_ignored():
    """A new prefill rank's first WARMUP seconds (and a starting rank) are slow; the old
    rank meets the objective: nothing grows. Without a warm-up the same trace grows."""
    def trace(warmup: float) -> Trace:
        t = Trace(prefill=1, decode=1, planner_warmup_s=warmup, planner_cooldown_s=INTERVAL,
                  max_prefill=4)
        t.ranks["prefill"].append(FakeRank(2, ready_at=2.0))  # ready at 2 s: warming
        t.ranks["prefill"].append(FakeRank(3, ready_at=None, state="starting"))
        t.ranks["decode"].append(FakeRank(2, ready_at=2.0))
        for i in range(12):  # 60 s: the new ranks are slow in their first 10 s only
            slow = t.at + INTERVAL <= 10.0
            if slow:  # the decode newcomer preempts in its first steps
                t.ranks["decode"][1].stats = {"num_preemptions": 5 * (i + 1)}
            t.step(ttft={1: 0.7, 2: 9.0 if slow else 0.7, 3: 9.0}, itl=0.07)
        return t

    assert trace(WARMUP).decisions == []
    # the control: with no warm-up, the same trace grows both pools at once
    control = trace(0.0)
    got = [(at, d.pool, d.to_replicas) for at, d in control.decisions]
    assert got == [(10.0, "prefill", 4), (10.0, "decode", 3)]
    assert "preempted 5 sequences" in control.of("decode")[0][1].reason


def test_pending_ranks_never_ask_for_more():
    """A resize to 3 whose two new ranks Ray has not placed yet: however long the TTFT
    breach lasts, the planner asks for nothing more; once the resize ends it waits a
    cooldown, then goes on from 3 (placed + pending), not from the 1 that served."""
    t = Trace(prefill=1, max_prefill=4)
    t.ranks["prefill"] += [FakeRank(2, None, "starting"), FakeRank(3, None, "starting")]
    t.resizing.add("prefill")
    t.run(100, ttft=4.0, itl=0.02)
    assert t.of("prefill") == []
    assert "pending ranks count as capacity" in t.planner.notes["prefill"]
    for r in t.ranks["prefill"][1:]:  # placed, at last
        r.state, r.ready_at = "ready", t.at
    t.resizing.clear()
    placed_at = t.at
    t.run(10, ttft=4.0, itl=0.02)
    (at, d), = t.of("prefill")
    assert (d.from_replicas, d.to_replicas) == (3, 4) and at >= placed_at + COOLDOWN


def test_idle_returns_both_pools_to_their_minima():
    t = Trace(prefill=3, decode=3)
    t.run(5, inflight=0)  # nothing in flight, queues empty, no sample
    assert t.decisions == []  # idle for less than a cooldown
    t.run(6, inflight=0)
    downs = sorted((d.pool, d.from_replicas, d.to_replicas) for _, d in t.decisions)
    assert downs == [("decode", 3, 1), ("prefill", 3, 1)]
    assert all("idle for" in d.reason for _, d in t.decisions)
    t.run(100, inflight=0)
    assert len(t.decisions) == 2  # and stays there


def test_a_load_that_stops_soon_after_a_change_is_judged_idle_not_calm():
    """The router test's race: prefill grew, the load ran on a little with no new TTFT
    sample and then stopped. Once the change's cooldown was over, "no recent TTFT sample"
    stepped prefill down before the idle rule could: idle owns an idle service."""
    t = Trace()
    t.run(7, ttft=2.0, itl=0.02)
    (grown_at, _), = t.of("prefill")
    t.run(5, itl=0.02)  # in flight, no prompt finished since the change
    idle_from = t.at + INTERVAL
    t.run(2, inflight=0)  # the change's cooldown is over, idle for less than one
    assert grown_at + COOLDOWN <= t.at < idle_from + COOLDOWN
    assert len(t.of("prefill")) == 1
    assert t.planner.notes["prefill"].startswith("idle for 5s: back to the minimum after 30s")
    t.run(5, inflight=0)
    (at, d), = t.of("prefill")[1:]
    assert (d.from_replicas, d.to_replicas) == (2, 1) and d.reason.startswith("idle for 30s")
    assert at == idle_from + COOLDOWN


def test_a_breach_measured_on_a_load_that_has_gone_grows_nothing():
    """Bench_autoscale's ttft run: the queue drained, the window still held the long
    TTFTs of the queued prompts, and a third prefill rank started with nothing to do."""
    t = Trace()
    t.run(6, ttft=2.0, itl=0.02)  # cooling down from the first look (t=5..30)
    t.run(1, ttft=2.0, itl=0.02, inflight=0)  # the breach is in the window; the load gone
    assert t.decisions == []
    assert t.planner.notes["prefill"].startswith("idle now, so not growing on: TTFT p90 2000 ms")
    assert t.planner.notes["decode"] == ""
    t.step(ttft=2.0, itl=0.02, inflight=3)  # load again: the breach grows prefill
    assert [(d.pool, d.to_replicas) for _, d in t.decisions] == [("prefill", 2)]


def test_a_light_load_steps_down_one_rank_per_cooldown_to_the_minima():
    t = Trace(prefill=3, decode=3)
    t.run(100, ttft=0.05, itl=0.005)  # requests in flight, fast
    assert t.size("prefill") == 1 and t.size("decode") == 1
    assert [(d.from_replicas, d.to_replicas) for _, d in t.of("prefill")] == [(3, 2), (2, 1)]


def test_decode_keeps_a_rank_the_others_could_not_hold_the_kv_of():
    t = Trace(decode=2)
    for r in t.ranks["decode"]:
        r.stats = {"kv_usage": 0.6}  # 120% on one rank
    t.run(60, ttft=0.05, itl=0.005)
    assert t.of("decode") == []
    for r in t.ranks["decode"]:
        r.stats = {"kv_usage": 0.3}
    t.run(10, ttft=0.05, itl=0.005)
    assert [(d.from_replicas, d.to_replicas) for _, d in t.of("decode")] == [(2, 1)]


def test_a_growing_prompt_queue_grows_prefill_before_any_ttft_sample():
    """Every request stuck before its first token: no TTFT sample yet, but the prompt
    tokens waiting per rank rise look after look."""
    t = Trace()
    t.run(7)  # past the first cooldown, nothing measured
    for i in range(4):
        t.ranks["prefill"][0].stats = {"waiting_prompt_tokens": 1000 * (i + 1),
                                       "num_waiting": 4 * (i + 1)}
        t.step()
    (_, d), = t.decisions
    assert d.pool == "prefill" and (d.from_replicas, d.to_replicas) == (1, 2)
    assert "prompt tokens waiting per prefill rank rose 3 looks in a row " \
        "(0 -> 1000 -> 2000 -> 3000)" in d.reason


def test_a_pool_outside_its_bounds_is_brought_in_at_once():
    t = Trace(prefill=1, decode=4, min_prefill=2, max_decode=3)
    t.step(inflight=0)
    got = sorted((d.pool, d.from_replicas, d.to_replicas, d.reason) for _, d in t.decisions)
    assert got == [("decode", 4, 3, "above the maximum 3"),
                   ("prefill", 1, 2, "below the minimum 2")]


def test_a_scale_up_ray_cannot_place_stops_at_what_is_placed_and_backs_off():
    t = Trace()
    t.fail_growth["prefill"] = True
    t.run(8, ttft=3.0, itl=0.02)
    (failed_at, d), = t.of("prefill")
    assert (d.from_replicas, d.to_replicas) == (1, 2) and t.size("prefill") == 1
    held = t.planner.held("prefill", t.at)
    assert held.startswith("held at 1: 2 ranks could not start (RankStartError")
    # the breach goes on: no retry before the back-off, and the note says why
    t.run(int(BACKOFF / INTERVAL) - 2, ttft=3.0, itl=0.02)
    assert len(t.of("prefill")) == 1
    assert "no retry for" in t.planner.notes["prefill"]
    t.fail_growth.clear()  # the cluster found room
    t.run(4, ttft=3.0, itl=0.02)
    (retry_at, retry), = t.of("prefill")[1:]
    assert retry_at >= failed_at + BACKOFF and (retry.from_replicas, retry.to_replicas) == (1, 2)
    assert t.size("prefill") == 2 and t.planner.held("prefill", t.at) == ""


def test_a_failure_that_is_not_placement_only_waits_a_cooldown():
    t = Trace()
    t.fail_growth["prefill"] = False  # e.g. a person's resize of the pool was in flight
    t.run(8, ttft=3.0, itl=0.02)
    (at, _), = t.of("prefill")
    assert t.planner.held("prefill", at) == "" and t.size("prefill") == 1
    t.fail_growth.clear()
    t.run(8, ttft=3.0, itl=0.02)
    (retry_at, retry), = t.of("prefill")[1:]
    assert retry_at == at + COOLDOWN and (retry.from_replicas, retry.to_replicas) == (1, 2)


@pytest.mark.parametrize("samples, breach", [(4, False), (5, True)])
def test_fewer_samples_than_the_minimum_judge_no_breach(samples, breach):
    t = Trace()
    t.run(7)
    t.at += INTERVAL
    t.emit("ttft", "prefill", 5.0, per_rank=samples)
    got = t.planner.decide(t.snapshot())
    assert bool(got) == breach
