"""Placement search (``pdserve simulate --plan``), as DistServe chooses placements.

For each way to split ``--gpus`` N ranks into prefill:decode (1:N-1 .. N-1:1) and for
normal mode with N ranks, a rate search finds the highest request rate at which at
least ``--slo-percentile`` percent of the requests meet both objectives (TTFT <=
``--slo-ttft-ms`` and TPOT, the request's mean inter-token latency, <= ``--slo-itl-ms``;
``bench/serve_metrics.meets_slos``); goodput per rank is that rate / N. The rate
search doubles the rate from ``--plan-start-rate`` until attainment fails, then
bisects ``--plan-steps`` times. Every candidate sees the same workload (the dataset
arguments, its arrivals scaled to each rate).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from pdserve.bench.serve_metrics import meets_slos
from pdserve.bench.serve_report import write_json
from pdserve.simulator.workload import workload_of


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("placement search (--plan)")
    g.add_argument("--plan", action="store_true",
                   help="search prefill:decode splits of --gpus ranks and normal mode for "
                   "the most goodput per rank")
    g.add_argument("--gpus", type=int, default=None, help="ranks to place")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-itl-ms", type=float, default=None)
    g.add_argument("--slo-percentile", type=float, default=90.0)
    g.add_argument("--plan-start-rate", type=float, default=1.0)
    g.add_argument("--plan-steps", type=int, default=6, help="bisections per rate search")


@dataclass(frozen=True)
class Placement:
    mode: str
    prefill: int = 0
    decode: int = 0
    replicas: int = 0

    @property
    def ranks(self) -> int:
        return self.prefill + self.decode + self.replicas

    @property
    def name(self) -> str:
        return f"{self.prefill}P+{self.decode}D" if self.mode == "disaggregated" \
            else f"normal x{self.replicas}"


def placements(gpus: int) -> list[Placement]:
    out = [Placement("disaggregated", p, gpus - p) for p in range(1, gpus)]
    return out + [Placement("normal", replicas=gpus)]


def attainment(records: list, slos: dict[str, float]) -> float:
    return sum(meets_slos(r, slos) for r in records) / len(records) if records else 0.0


def search_rate(attained, start: float, steps: int, max_doublings: int = 20) -> tuple[float, list]:
    """The highest rate with ``attained(rate)`` true (0 if none), and every (rate,
    attainment ok) tried."""
    tried = []
    lo, hi, rate = 0.0, None, start
    for _ in range(max_doublings):
        ok = attained(rate)
        tried.append((rate, ok))
        if not ok:
            hi = rate
            break
        lo, rate = rate, rate * 2
    if hi is None:
        return lo, tried
    for _ in range(steps):
        mid = (lo + hi) / 2
        ok = attained(mid)
        tried.append((mid, ok))
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, tried


def run_plan(args: argparse.Namespace, config, costs) -> int:
    # lazy: simulator.cluster is the whole simulator: only --plan runs need it, not the parser
    from pdserve.simulator.cluster import Cluster

    if not args.gpus or args.gpus < 1 or args.slo_ttft_ms is None or args.slo_itl_ms is None:
        print("error: --plan needs --gpus N, --slo-ttft-ms and --slo-itl-ms", file=sys.stderr)
        return 2
    slos = {"ttft": args.slo_ttft_ms, "tpot": args.slo_itl_ms}
    target = args.slo_percentile / 100.0
    rows = []
    for place in placements(args.gpus):
        cfg = replace(config, mode=place.mode, prefill=place.prefill or 1,
                      decode=place.decode or 1, replicas=place.replicas or 1)

        def attained(rate: float, cfg=cfg) -> bool:
            sim = Cluster(cfg, costs).run(workload_of(args, rate))
            return attainment(sim.records, slos) >= target

        best, tried = search_rate(attained, args.plan_start_rate, args.plan_steps)
        rows.append({"placement": place.name, "mode": place.mode, "prefill": place.prefill,
                     "decode": place.decode, "replicas": place.replicas, "ranks": place.ranks,
                     "max_rate": best, "goodput_per_rank": best / place.ranks,
                     "rates_tried": tried})
        print(f"plan: {place.name}: {best:.3g} req/s meet the SLOs "
              f"({len(tried)} runs)", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: -r["goodput_per_rank"])
    print(f"{'placement':<14} {'max rate (req/s)':>18} {'goodput/rank':>14}")
    for r in rows:
        print(f"{r['placement']:<14} {r['max_rate']:>18.3f} {r['goodput_per_rank']:>14.3f}")
    out = {"slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms,
           "slo_percentile": args.slo_percentile, "gpus": args.gpus, "table": rows}

    out["serve_command"] = serve_command(rows[0], args)
    write_json(args.result_file, out)
    print(f"best: {rows[0]['placement']}; wrote {args.result_file}")
    print(f"start from it: {out['serve_command']}")
    return 0


def serve_command(best: dict, args: argparse.Namespace) -> str:
    """`pdserve serve` at the placement found; for a split, with the planner on at the
    same objectives and the split as its minima (it grows from there, never below)."""
    if best["mode"] == "normal":
        return f"pdserve serve --mode normal --normal {best['replicas']}"
    p, d = best["prefill"], best["decode"]
    return (f"pdserve serve --prefill {p} --decode {d} --autoscale --slo-ttft-ms "
            f"{args.slo_ttft_ms:g} --slo-itl-ms {args.slo_itl_ms:g} --min-prefill {p} "
            f"--max-prefill {_room(p)} --min-decode {d} --max-decode {_room(d)}")


def _room(n: int) -> int:
    """A maximum for a pool found best at n ranks: twice it, within RouterConfig's
    default max_replicas (16; past that the YAML must raise max_replicas)."""
    return max(n, min(2 * n, 16))


__all__ = ["Placement", "add_plan_args", "attainment", "placements", "run_plan",
           "search_rate", "serve_command"]
