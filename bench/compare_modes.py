"""Disaggregated vs normal serving on the same machine, the same mixed workload, one run.

    pdserve bench compare-modes                      # 1 prefill + 1 decode vs 2 NORMAL ranks
    pdserve bench compare-modes --num-prompts 60 --request-rate 4 --goodput ttft:2000 tpot:100

Each deployment is brought up in turn (`pdserve serve` in a subprocess with its own
embedded Ray, by default; `--launch inprocess` runs the router on a thread of this
process instead), loaded with the same seeded requests at the same seeded arrival
times (`bench/serve_client.py`), and shut down. With the mixed workload each deployment then
also serves the short chats alone (a control, at their share of the rate): the ratio
of the chats' ITL with and without long prompts among them is the interference that
disaggregation is meant to remove. Writes JSON (full results; a side by side table of
p99 ITL, TTFT and goodput, overall and per class, with normal / disaggregated ratios;
the interference table) and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.plots import plot_compare
from pdserve.bench.routers import inprocess_router, subprocess_router
from pdserve.bench.serve import add_dataset_args, add_load_args, build_requests, load_kwargs
from pdserve.bench.serve_client import collect
from pdserve.bench.serve_report import summarize, write_json
from pdserve.bench.standalone import standalone_main
from pdserve.engine.model.catalog import resolve_model
from pdserve.router.embedded_ray import idle_openmp_passively

DEPLOYMENTS = {
    "disaggregated": {"mode": "disaggregated", "prefill": 1, "decode": 1},
    "normal": {"mode": "normal", "normal": 2},
}
COMPARED = ("p99_itl_ms", "median_itl_ms", "p99_ttft_ms", "median_ttft_ms", "p99_tpot_ms",
            "p99_e2el_ms", "request_goodput", "request_throughput", "output_throughput")


def side_by_side(results: dict[str, dict], baseline: str = "disaggregated") -> dict:
    """{metric: {deployment: value, ..., "ratio_<other>_to_<baseline>": x}} for the
    whole workload and for each dataset class (e.g. the short chats alone)."""
    def table(get) -> dict:
        out = {}
        for key in COMPARED:
            row = {name: get(r).get(key) for name, r in results.items()}
            base = row.get(baseline)
            for name, v in list(row.items()):
                if name != baseline and v is not None and base:
                    row[f"ratio_{name}_to_{baseline}"] = v / base
            out[key] = row
        return out

    kinds = sorted({k for r in results.values() for k in r.get("by_kind", {})})
    return {"all": table(lambda r: r),
            **{k: table(lambda r, k=k: r.get("by_kind", {}).get(k, {})) for k in kinds}}


def control_requests(requests: list) -> list:
    """The short chats of a mixed workload alone (the control without long prompts)."""
    return [r for r in requests if r.kind == "short"]


def interference(results: dict[str, dict], controls: dict[str, dict], kind: str = "short") -> dict:
    """Per deployment: the short chats' latency with long prompts among them, without,
    and the ratio (1.0 = the long prefills do not disturb the chats at all)."""
    out = {}
    for name, r in results.items():
        c = controls.get(name)
        if c is None:
            continue
        mixed = r.get("by_kind", {}).get(kind, {})
        alone = c.get("by_kind", {}).get(kind, c)
        row = {}
        for key in ("p99_itl_ms", "median_itl_ms", "p99_tpot_ms", "p99_ttft_ms"):
            a, b = mixed.get(key), alone.get(key)
            row[key] = {"with_long": a, "short_only": b,
                        "ratio": (a / b) if a is not None and b else None}
        out[name] = row
    return out


@dataclass
class _Rounds:
    """The runs of each deployment so far (and of its control: the short chats alone)."""

    launchers: dict[str, contextlib.AbstractContextManager]
    requests: list
    shorts: list  # the control's requests; empty: no control
    collect_kw: dict
    rate: float
    rounds: int
    runs: dict[str, list] = field(init=False)
    controls: dict[str, list] = field(init=False)
    startup: dict[str, float] = field(default_factory=dict)  # seconds to bring each up

    def __post_init__(self) -> None:
        self.runs = {n: [] for n in self.launchers}
        self.controls = {n: [] for n in self.launchers}

    def run(self, name: str, address: str, k: int) -> None:
        """Round `k` of deployment `name`: the workload, then its control."""
        print(f"{name}: round {k + 1}/{self.rounds}, {len(self.requests)} requests ...",
              file=sys.stderr, flush=True)
        kw = dict(self.collect_kw, label=name)
        if k:
            kw["num_warmups"] = 0
        self.runs[name].append(asyncio.run(collect(address, self.requests, **kw)))
        if self.shorts:
            kw.update(num_warmups=0, label=f"{name} (short only)",
                      request_rate=self.rate * len(self.shorts) / len(self.requests))
            self.controls[name].append(asyncio.run(collect(address, self.shorts, **kw)))

    def start(self, stack: contextlib.ExitStack, name: str) -> str:
        """Brings deployment `name` up (down when `stack` closes); its address."""
        t = time.perf_counter()
        address = stack.enter_context(self.launchers[name])
        self.startup[name] = time.perf_counter() - t
        print(f"{name}: router at {address} (up in {self.startup[name]:.1f} s)",
              file=sys.stderr, flush=True)
        return address

    def run_all(self) -> None:
        """Every round: one deployment up at a time, or all up together in turns."""
        names = list(self.launchers)
        if self.rounds == 1:
            for name in names:
                with contextlib.ExitStack() as stack:
                    self.run(name, self.start(stack, name), 0)
            return
        with contextlib.ExitStack() as stack:
            addresses = {name: self.start(stack, name) for name in names}
            for k in range(self.rounds):
                for name in (names if k % 2 == 0 else names[::-1]):
                    self.run(name, addresses[name], k)


def compare(launchers: dict[str, contextlib.AbstractContextManager], requests: list,
            control: bool = False, rounds: int = 1, **bench_kwargs) -> dict:
    """Run `requests` against each deployment; `launchers` maps a name to a context
    manager that yields the router's address.

    rounds = 1: one deployment up at a time, in turn. rounds > 1: all of them up at
    once (idle pools park), the workload run `rounds` times in alternating order
    (A B, B A, ...) so a noisy neighbour hits both alike; each deployment's runs are
    merged into one result. With `control`, every run of the mixed workload is
    followed by the short chats alone, at their own share of the request rate.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not requests:
        raise ValueError("no requests to send")
    shorts = control_requests(requests) if control else []
    collect_kw = {k: v for k, v in bench_kwargs.items() if k not in ("slos", "percentiles")}
    rate = bench_kwargs.get("request_rate", math.inf)
    deployments = _Rounds(launchers, requests, shorts, collect_kw, rate, rounds)
    deployments.run_all()

    names = list(launchers)
    results = {}
    for name in names:
        results[name] = summarize(deployments.runs[name], label=name, **bench_kwargs)
        results[name]["startup_s"] = deployments.startup[name]
    out = {"deployments": results, "comparison": side_by_side(results), "rounds": rounds}
    if shorts:
        kw = dict(bench_kwargs, request_rate=rate * len(shorts) / len(requests))
        controls = {n: summarize(deployments.controls[n], label=f"{n} (short only)", **kw)
                    for n in names}
        out["controls"] = controls
        out["interference"] = interference(results, controls)
    return out


def format_comparison(cmp: dict) -> str:
    lines = []
    for part, table in cmp.items():
        names = [n for n in next(iter(table.values())) if not n.startswith("ratio_")]
        ratios = [n for n in next(iter(table.values())) if n.startswith("ratio_")]
        lines.append(f"-- {part} --")
        lines.append(f"{'metric':<22}" + "".join(f"{n:>16}" for n in names + ratios))
        for key, row in table.items():
            cells = []
            for n in names + ratios:
                v = row.get(n)
                cells.append(f"{'n/a':>16}" if v is None else f"{v:>16.3f}")
            lines.append(f"{key:<22}" + "".join(cells))
    return "\n".join(lines)


def format_interference(table: dict) -> str:
    lines = ["-- short chats: with long prompts among them / alone --"]
    for name, row in table.items():
        cells = []
        for key, v in row.items():
            r = v["ratio"]
            a, b = (("n/a" if x is None else f"{x:.1f}") for x in (v["with_long"], v["short_only"]))
            cells.append(f"{key} {a}/{b} = " + ("n/a" if r is None else f"{r:.2f}x"))
        lines.append(f"{name:<14} " + "; ".join(cells))
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    add_dataset_args(p)
    add_load_args(p)
    p.set_defaults(dataset_name="mixed", num_prompts=40, request_rate=4.0,
                   goodput=["ttft:3000", "tpot:150"])
    p.add_argument("--launch", choices=["subprocess", "inprocess"], default="subprocess",
                   help="how to bring each deployment up (default %(default)s)")
    p.add_argument("--modes", default="disaggregated,normal",
                   help="deployments to run, in this order (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="1: deployments up one at a time; N > 1: all up together, the "
                   "workload run N times in alternating order, runs merged")
    p.add_argument("--no-control", action="store_true",
                   help="skip the control run of the short chats alone in each deployment")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-transport", choices=["ray", "grpc"], default="ray")
    p.add_argument("--result-file", default="results/bench_compare_modes.json")
    p.add_argument("--plot", default=None, help="PNG out (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true")


def run(args: argparse.Namespace) -> int:
    idle_openmp_passively()

    names = [m for m in args.modes.replace(",", " ").split()]
    unknown = [m for m in names if m not in DEPLOYMENTS]
    if unknown or not names:
        print(f"error: --modes takes {'/'.join(DEPLOYMENTS)}, got {args.modes!r}", file=sys.stderr)
        return 2

    model = resolve_model(args.model).path
    args.model = model
    requests = build_requests(args)
    kwargs = load_kwargs(args)
    kwargs["request_rate"] = args.request_rate
    engine = {"max_num_seqs": args.max_num_seqs}
    if args.num_kv_blocks:
        engine["num_kv_blocks"] = args.num_kv_blocks
    launchers = {}
    for name in names:
        spec = DEPLOYMENTS[name]
        if args.launch == "subprocess":
            launchers[name] = subprocess_router(spec, model=model, kv_transport=args.kv_transport,
                                                num_kv_blocks=args.num_kv_blocks,
                                                max_num_seqs=args.max_num_seqs)
        else:
            launchers[name] = inprocess_router(spec, model=model, engine=engine,
                                               kv_transport=args.kv_transport)
    try:
        out = compare(launchers, requests, rounds=args.rounds,
                      control=not args.no_control and args.dataset_name == "mixed", **kwargs)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.launch == "inprocess":
            # lazy: ray is heavy; only --launch inprocess started it here
            import ray

            ray.shutdown()
    out["workload"] = {
        "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "seed": args.seed, "goodput_slos_ms": kwargs["slos"],
        "mixed": {"long_ratio": args.mixed_long_ratio, "long_input_len": args.mixed_long_input_len,
                  "long_output_len": args.mixed_long_output_len,
                  "short_input_len": args.mixed_short_input_len,
                  "short_output_len": args.mixed_short_output_len},
        "launch": args.launch, "rounds": args.rounds, "model": model, "engine": engine,
        "deployments": {n: DEPLOYMENTS[n] for n in names}}
    print(format_comparison(out["comparison"]), flush=True)
    if "interference" in out:
        print(format_interference(out["interference"]), flush=True)
    write_json(args.result_file, out)
    if not args.no_plot:
        plot = args.plot or str(Path(args.result_file).with_suffix(".png"))
        kind = "short" if args.dataset_name == "mixed" else None
        plot_compare(out["deployments"], plot, kind=kind, interference=out.get("interference"),
                     title=f"{args.dataset_name} workload, {args.num_prompts} requests at "
                     f"{args.request_rate:g} req/s")
        print(f"wrote {args.result_file} and {plot}")
    else:
        print(f"wrote {args.result_file}")
    return 0


main = standalone_main(__doc__, add_args, run)


if __name__ == "__main__":
    sys.exit(main())
