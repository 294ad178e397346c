"""The SLO planner live: loads against a real autoscaling router, and what it did.

    python bench/autoscale.py                            # the three scenarios (~12 min)
    python bench/autoscale.py --scenarios itl --load-s 60 --quiet-s 90

Each scenario starts a fresh router with `autoscale` on (real Ray actors, gRPC, the
built-in tiny model, RouterHarness in this process), sends `bench serve`'s load on a
rate schedule (`load_s` of load, then `quiet_s` of none) while a PoolSampler records
the pools every second, and reports from the planner's decisions and the samples:

  ttft         1024-token prompts, 4 tokens out, above what one prefill rank prefills
               on this machine: TTFT breaks its objective, ITL does not. Expected:
               prefill grows, decode does not; both back to their minima once quiet.
  itl          48-token prompts, 192 tokens out, many streams at once: ITL breaks its
               objective, TTFT does not. Expected: decode grows, prefill does not.
  unplaceable  the itl load on a decode pool that starts at 2 ranks with a maximum of
               4, where Ray has room for 2 decode ranks only: the planner asks for a
               third, Ray cannot place it, the resize fails within rank_start_timeout_s
               and the pool is held at 2 with the reason. Expected: no wedge (requests
               served throughout), never more than 2 decode ranks.

Per scenario: when each pool first grew (the decision, and the sample that saw the
rank ready), how many ranks it reached, how long after the load stopped both pools
were back at their minima, every request's outcome, and whether the ranks held
anything afterwards. The planner runs with its defaults (RouterConfig) unless a flag
here changes them; the objectives are set per scenario for this machine's speeds.
Writes results/bench_autoscale.json and results/bench_autoscale_<scenario>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.bench.datasets import random_requests
from pdserve.bench.harness import RouterHarness, start_embedded_ray
from pdserve.bench.load_timeline import RateSchedule
from pdserve.bench.plots import plot_pool_timeline
from pdserve.bench.serve_client import collect
from pdserve.bench.serve_report import summarize, write_json
from pdserve.router.config import PoolConfig, RouterConfig

# Ray's room for decode ranks (each asks for one unit): what makes `unplaceable` so.
DECODE_UNITS = 2


@dataclass(frozen=True)
class Scenario:
    name: str
    input_len: int
    output_len: int
    rate: float  # requests per second during the load
    slo_ttft_ms: float
    slo_itl_ms: float
    prefill: tuple[int, int]  # (min, max)
    decode: tuple[int, int]
    expect_growth: str  # the pool that should grow ("" for none)
    rank_start_timeout_s: float | None = None  # None: RouterConfig's


SCENARIOS = {
    "ttft": Scenario("ttft", 1024, 4, 11.0, slo_ttft_ms=1000, slo_itl_ms=1000,
                     prefill=(1, 3), decode=(1, 2), expect_growth="prefill"),
    "itl": Scenario("itl", 48, 256, 10.0, slo_ttft_ms=5000, slo_itl_ms=12,
                    prefill=(1, 3), decode=(1, 2), expect_growth="decode"),
    "unplaceable": Scenario("unplaceable", 48, 256, 10.0, slo_ttft_ms=5000, slo_itl_ms=12,
                            prefill=(1, 1), decode=(2, 4), expect_growth="",
                            rank_start_timeout_s=30.0),
}


@dataclass
class Outcome:
    scenario: str
    requests: int = 0
    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    first_growth_s: dict[str, float | None] = field(default_factory=dict)
    first_ready_s: dict[str, float | None] = field(default_factory=dict)
    most_ready: dict[str, int] = field(default_factory=dict)
    load_end_s: float = 0.0
    left_minima: bool = False  # some pool grew (or was asked to) during the run
    back_to_minima_s: float | None = None  # after the load's last request ended
    notes: dict[str, str] = field(default_factory=dict)
    leftovers: str = ""  # what the ranks still held afterwards ("" = nothing)


def router_config(model: str, s: Scenario, args: argparse.Namespace):
    engine = {"max_num_seqs": 64}
    planner = {k: getattr(args, k) for k in ("planner_interval_s", "planner_cooldown_s",
                                            "planner_warmup_s", "planner_window_s")
               if getattr(args, k) is not None}
    if s.rank_start_timeout_s is not None:
        planner["rank_start_timeout_s"] = s.rank_start_timeout_s
    return RouterConfig(
        model_dir=model, port=0, http_port=0, metrics_port=0,
        prefill=PoolConfig("prefill", replicas=s.prefill[0], num_cpus=0.25,
                           resources={"prefill": 1}, engine=engine),
        decode=PoolConfig("decode", replicas=s.decode[0], num_cpus=0.25,
                          resources={"decode": 1}, engine=engine),
        autoscale=True, slo_ttft_ms=s.slo_ttft_ms, slo_itl_ms=s.slo_itl_ms,
        min_prefill=s.prefill[0], max_prefill=s.prefill[1],
        min_decode=s.decode[0], max_decode=s.decode[1], **planner)


def judge(s: Scenario, result: dict, bounds: dict[str, tuple[int, int]]) -> Outcome:
    """The scenario's numbers from bench serve's result (its pool_timeline)."""
    tl = result["pool_timeline"]
    samples, planner = tl["samples"], tl["planner"] or {"decisions": []}
    start = tl["start_unix_s"]
    out = Outcome(s.name, requests=result["num_prompts"], completed=result["completed"])
    out.errors = sorted({e for e in result["errors"] if e})
    out.failed = sum(1 for e in result["errors"] if e)
    out.decisions = [dict(d, at_s=round(d["at"] - start, 1)) for d in planner["decisions"]]
    ends = [o + e for o, e in zip(result["send_offsets"], result["e2els"], strict=True)]
    out.load_end_s = round(max(ends), 1)
    for pool, (low, _high) in bounds.items():
        grew = [d for d in out.decisions if d["pool"] == pool and d["to"] > d["from"]]
        out.first_growth_s[pool] = grew[0]["at_s"] if grew else None
        above = [x["t"] for x in samples if x["ready"].get(pool, 0) > low]
        out.first_ready_s[pool] = round(above[0], 1) if above else None
        out.most_ready[pool] = max(x["ready"].get(pool, 0) for x in samples)
    out.left_minima = any(x["target"].get(p, 0) > low or x["ready"].get(p, 0) > low
                          for x in samples for p, (low, _h) in bounds.items())
    at_minima = [x["t"] for x in samples if x["t"] >= out.load_end_s and all(
        x["ready"].get(p, 0) == low and x["target"].get(p, 0) == low
        for p, (low, _h) in bounds.items())]
    if at_minima and out.left_minima:
        out.back_to_minima_s = round(at_minima[0] - out.load_end_s, 1)
    out.notes = samples[-1]["notes"] if samples else {}
    return out


def run_scenario(model: str, s: Scenario, args: argparse.Namespace, results: Path) -> Outcome:
    schedule = RateSchedule.parse(f"{args.load_s}:{s.rate},{args.quiet_s}:0")
    offsets = schedule.offsets(seed=args.seed)
    requests = random_requests(len(offsets), s.input_len, s.output_len, vocab_size=4096,
                               seed=args.seed)
    config = router_config(model, s, args)
    print(f"== {s.name}: {len(requests)} requests ({s.input_len} in, {s.output_len} out) "
          f"over {schedule.describe()}; objectives TTFT {s.slo_ttft_ms:g} ms, ITL "
          f"{s.slo_itl_ms:g} ms; prefill {s.prefill}, decode {s.decode}", flush=True)
    h = RouterHarness(config)
    try:
        run = asyncio.run(collect(h.address, requests, offsets=offsets, hold_s=schedule.total_s,
                                  sample_interval_s=1.0, num_warmups=1, progress=False,
                                  request_timeout=args.request_timeout, label=s.name))
        result = summarize([run], address=h.address, label=s.name, rate_schedule=schedule)
        bounds = {"prefill": s.prefill, "decode": s.decode}
        out = judge(s, result, bounds)
        try:
            h.assert_nothing_left(timeout=60)
        except AssertionError as exc:
            out.leftovers = str(exc)[:500] or "assert_nothing_left failed"
    finally:
        h.close()
    write_json(results / f"bench_autoscale_{s.name}.json", result)
    plot_pool_timeline(result["pool_timeline"], results / f"bench_autoscale_{s.name}.png",
                       title=f"autoscale: {s.name}")
    return out


def format_outcome(o: Outcome) -> str:
    lines = [f"-- {o.scenario}: {o.completed}/{o.requests} completed, {o.failed} failed"
             + (f" ({'; '.join(o.errors)[:200]})" if o.errors else "")]
    for pool in o.first_growth_s:
        lines.append(f"   {pool}: first grew at {o.first_growth_s[pool]} s (decision), ready at "
                     f"{o.first_ready_s[pool]} s, most ready {o.most_ready[pool]}")
    back = (f"{o.back_to_minima_s} s later" if o.back_to_minima_s is not None
            else "not within the run" if o.left_minima else "(never left them)")
    lines.append(f"   load ended at {o.load_end_s} s; back to the minima {back}")
    for d in o.decisions:
        lines.append(f"   t={d['at_s']:>6} s {d['pool']} {d['from']}->{d['to']} [{d['outcome']}]"
                     f" {d['reason']}" + (f" ({d['error'][:120]})" if d["error"] else ""))
    for pool, note in o.notes.items():
        lines.append(f"   note {pool}: {note}")
    lines.append(f"   left on the ranks: {o.leftovers or 'nothing'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated, of " + ", ".join(SCENARIOS))
    p.add_argument("--load-s", type=float, default=120.0, help="seconds of load")
    p.add_argument("--quiet-s", type=float, default=150.0, help="seconds of none after it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--model", default=None, help="model folder (default: the built-in one)")
    for name in ("planner_interval_s", "planner_cooldown_s", "planner_warmup_s",
                 "planner_window_s"):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=float, default=None,
                       help="(default: RouterConfig's)")
    p.add_argument("--result-dir", default="results")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")

    # before ray is imported: it binds loopback then
    model = start_embedded_ray(args.model, resources={"prefill": 8, "decode": DECODE_UNITS})
    results = Path(args.result_dir)
    results.mkdir(parents=True, exist_ok=True)
    outcomes = []
    started = time.monotonic()
    for name in names:
        outcome = run_scenario(model, SCENARIOS[name], args, results)
        print(format_outcome(outcome), flush=True)
        outcomes.append(outcome)
    path = write_json(results / "bench_autoscale.json", {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "decode_units": DECODE_UNITS,
        "load_s": args.load_s, "quiet_s": args.quiet_s,
        "scenarios": {n: asdict(SCENARIOS[n]) for n in names},
        "outcomes": [asdict(o) for o in outcomes]})
    print(f"wrote {path} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0 if all(o.failed == 0 and not o.leftovers for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
