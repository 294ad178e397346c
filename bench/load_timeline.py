"""A load that steps up and down, and what the pools did under it.

    pdserve bench serve --rate-schedule 60:1,120:6,180:0 --timeline results/run.png

`--rate-schedule SECONDS:RATE,...` sends requests at each RATE (requests per second,
0 for none) for its SECONDS, one step after another: a seeded gamma/Poisson process
per step (`--burstiness` as for `--request-rate`), as many requests as the schedule
draws (`--num-prompts` is not used). The run lasts the schedule's length at least, so
a trailing `:0` step watches the pools settle once the load has stopped.

During a run with `--rate-schedule` or `--timeline`, a `PoolSampler` asks the router
for its cluster state every `--sample-interval` seconds: ready and starting ranks and
the target size per pool, requests in flight, the recent TTFT and ITL the planner
judges, its notes. The JSON gets them as `pool_timeline` (beside the planner's
decisions and, per time bin, the load sent and the share of requests that met the
objectives: SLO attainment); `--timeline FILE.png` draws them in `FILE_pools.png`.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from pdserve.bench.serve_metrics import meets_slos

# A schedule draws at most this many requests: a typo (60:6000) must not build a
# million prompts before the first is sent.
MAX_SCHEDULED_REQUESTS = 200_000
MAX_SCHEDULE_S = 24 * 3600.0


@dataclass(frozen=True)
class RateStep:
    duration_s: float
    rate: float  # requests per second; 0: no load for the step


@dataclass(frozen=True)
class RateSchedule:
    steps: tuple[RateStep, ...]

    @classmethod
    def parse(cls, text: str) -> RateSchedule:
        """"60:1,120:6,180:0" -> 60 s at 1 req/s, 120 s at 6, 180 s of none."""
        steps = []
        for part in (p.strip() for p in str(text).split(",")):
            seconds, sep, rate = part.partition(":")
            try:
                step = RateStep(float(seconds), float(rate)) if sep else None
            except ValueError:
                step = None
            if step is None:
                raise ValueError(f"--rate-schedule takes SECONDS:RATE,... (e.g. 60:1,120:6,"
                                 f"180:0), got {part!r}")
            if not 0 < step.duration_s < math.inf:
                raise ValueError(f"--rate-schedule {part!r}: the seconds must be > 0")
            if not 0 <= step.rate < math.inf:
                raise ValueError(f"--rate-schedule {part!r}: the rate must be >= 0 and finite")
            steps.append(step)
        schedule = cls(tuple(steps))
        if not any(s.rate > 0 for s in steps):
            raise ValueError("--rate-schedule: every step has rate 0, so nothing would be sent")
        if schedule.total_s > MAX_SCHEDULE_S:
            raise ValueError(f"--rate-schedule lasts {schedule.total_s:g} s, over the "
                             f"{MAX_SCHEDULE_S:g} s limit")
        expected = sum(s.duration_s * s.rate for s in steps)
        if expected > MAX_SCHEDULED_REQUESTS:
            raise ValueError(f"--rate-schedule would send about {expected:.0f} requests, over "
                             f"the {MAX_SCHEDULED_REQUESTS} limit")
        return schedule

    @property
    def total_s(self) -> float:
        return sum(s.duration_s for s in self.steps)

    def rate_at(self, t: float) -> float:
        """The scheduled rate at `t` seconds after the start (0 after the end)."""
        start = 0.0
        for s in self.steps:
            if start <= t < start + s.duration_s:
                return s.rate
            start += s.duration_s
        return 0.0

    def offsets(self, burstiness: float = 1.0, seed: int = 0) -> list[float]:
        """Send times (seconds after the start): per step, gamma gaps of mean 1/rate
        (shape `burstiness`, 1 = Poisson) from the step's start, kept within the step."""
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        rng = np.random.default_rng(seed)
        out: list[float] = []
        start = 0.0
        for s in self.steps:
            end = start + s.duration_s
            if s.rate > 0:
                t = start
                scale = 1.0 / (s.rate * burstiness)
                while True:
                    # draw in batches of the expected count: a step of many requests
                    # costs a few numpy calls, not one per request
                    n = max(16, int(s.rate * (end - t) * 1.2))
                    times = t + np.cumsum(rng.gamma(burstiness, scale, size=n))
                    inside = times[times < end]
                    out.extend(inside.tolist())
                    if inside.size < n:
                        break
                    t = float(times[-1])
            start = end
        return out

    def describe(self) -> str:
        return ", ".join(f"{s.duration_s:g} s at {s.rate:g}/s" for s in self.steps)


# ---- sampling the pools ------------------------------------------------------------------

@dataclass
class PoolSample:
    """The router's cluster state at `t` seconds after the run's start."""

    t: float
    ready: dict[str, int]
    starting: dict[str, int]
    target: dict[str, int]
    num_inflight: int
    ttft_p90_ms: float
    itl_p90_ms: float
    notes: dict[str, str] = field(default_factory=dict)


def sample_of(state, t: float) -> PoolSample:
    ready, starting, target = {}, {}, {}
    for pool in state.pools:
        ready[pool.name] = sum(1 for r in pool.ranks if r.state == "ready")
        starting[pool.name] = sum(1 for r in pool.ranks if r.state == "starting")
        target[pool.name] = int(pool.target_replicas)
    pl = state.planner
    return PoolSample(round(t, 3), ready, starting, target, int(state.num_inflight),
                      float(pl.ttft_p90_ms), float(pl.itl_p90_ms),
                      {k: v for k, v in pl.notes.items() if v})


def checked_interval(seconds: float) -> float:
    """A sampling interval within bounds (--sample-interval), else ValueError."""
    if not 0.05 <= seconds <= 600:
        raise ValueError(f"--sample-interval must be in [0.05, 600] seconds, got {seconds}")
    return seconds


class PoolSampler:
    """Asks `client.cluster_state()` every `interval_s` while a run goes on. A sample
    that fails or takes longer than the interval is counted and skipped: a router busy
    resizing costs the picture a point, never the run."""

    def __init__(self, client, interval_s: float = 1.0) -> None:
        self.client = client
        self.interval_s = checked_interval(interval_s)
        self.samples: list[PoolSample] = []
        self.num_failed = 0
        self.last_state = None
        self._task: asyncio.Task | None = None

    def start(self, start: float) -> None:
        self._task = asyncio.ensure_future(self._run(start))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:  # the final state: the planner's decisions up to the end
            self.last_state = await asyncio.wait_for(self.client.cluster_state(),
                                                     timeout=max(5.0, self.interval_s))
        except Exception as exc:  # noqa: BLE001 - the run's results stand without it
            print(f"pool timeline: the last cluster state failed ({exc})", file=sys.stderr)

    async def _run(self, start: float) -> None:
        while True:
            asked = time.perf_counter()
            try:
                state = await asyncio.wait_for(self.client.cluster_state(),
                                               timeout=max(1.0, self.interval_s))
                self.last_state = state
                self.samples.append(sample_of(state, asked - start))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - see the class docstring
                self.num_failed += 1
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - asked)))


# ---- the timeline's numbers ------------------------------------------------------------

def planner_of(state) -> dict | None:
    """The planner's objectives and decisions (`at`: unix seconds) from a cluster state."""
    if state is None:
        return None
    pl = state.planner
    return {"enabled": bool(pl.enabled), "slo_ttft_ms": pl.slo_ttft_ms,
            "slo_itl_ms": pl.slo_itl_ms, "slo_percentile": pl.slo_percentile,
            "bounds": {"prefill": [pl.min_prefill, pl.max_prefill],
                       "decode": [pl.min_decode, pl.max_decode]},
            "decisions": [{"at": d.at, "pool": d.pool, "from": d.from_replicas,
                           "to": d.to_replicas, "reason": d.reason, "outcome": d.outcome,
                           "error": d.error} for d in pl.decisions]}


def objectives(slos: dict[str, float] | None, planner: dict | None) -> dict[str, float]:
    """What attainment is judged on: `--goodput`'s SLOs, else the planner's objectives
    (TTFT, and ITL as each request's TPOT), else none."""
    if slos:
        return dict(slos)
    if planner and planner["enabled"]:
        return {"ttft": planner["slo_ttft_ms"], "tpot": planner["slo_itl_ms"]}
    return {}


def attainment_bins(records, start: float, bin_s: float, slos: dict[str, float]) -> list[dict]:
    """Per `bin_s` seconds of send time: requests sent, the rate they make, how many
    failed, and the share that met every SLO (None without SLOs or requests)."""
    if not records:
        return []
    last = max(r.send_time - start for r in records)
    bins = [{"t": i * bin_s, "sent": 0, "failed": 0, "met": 0}
            for i in range(int(last // bin_s) + 1)]
    for r in records:
        b = bins[max(0, int((r.send_time - start) // bin_s))]
        b["sent"] += 1
        b["failed"] += 0 if r.success else 1
        b["met"] += 1 if slos and meets_slos(r, slos) else 0
    for b in bins:
        b["rate"] = b["sent"] / bin_s
        b["attainment"] = b["met"] / b["sent"] if slos and b["sent"] else None
    return bins


def pool_timeline(run, *, slos: dict[str, float] | None, schedule: RateSchedule | None,
                  bin_s: float | None = None) -> dict | None:
    """The JSON's `pool_timeline` for one run with a sampler (None without one)."""
    sampler = getattr(run, "sampler", None)
    if sampler is None:
        return None
    planner = planner_of(sampler.last_state)
    judged = objectives(slos, planner)
    span = max(run.duration, schedule.total_s if schedule else 0.0)
    bin_s = bin_s or max(1.0, round(span / 60))
    return {"sample_interval_s": sampler.interval_s, "num_failed_samples": sampler.num_failed,
            "samples": [asdict(s) for s in sampler.samples],
            "schedule": [asdict(s) for s in schedule.steps] if schedule else None,
            "start_unix_s": run.wall_start, "bin_s": bin_s, "objectives_ms": judged,
            "bins": attainment_bins(run.records, run.start, bin_s, judged),
            "planner": planner}
