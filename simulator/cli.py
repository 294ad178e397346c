"""``pdserve simulate``: a workload of ``bench serve`` (or a trace) on a simulated
cluster; prints bench serve's summary and writes its JSON (vLLM's field names)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_RESULT = "results/simulate.json"


def add_args(p: argparse.ArgumentParser) -> None:
    # lazy: `import pdserve.cli` stays light: bench serve's arguments load with the parser
    from pdserve.bench.serve import add_dataset_args, add_load_args

    g = p.add_argument_group("cluster")
    g.add_argument("--mode", choices=["disaggregated", "normal"], default="disaggregated")
    g.add_argument("--prefill", type=int, default=1, help="prefill ranks (disaggregated)")
    g.add_argument("--decode", type=int, default=1, help="decode ranks (disaggregated)")
    g.add_argument("--replicas", type=int, default=1, help="ranks of the normal pool")
    g.add_argument("--routing", choices=["cache_aware", "least_loaded"], default="cache_aware")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-kv-streaming", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per rank (default: the engine's sizing)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--cost-model", default=None, metavar="FILE",
                   help="step and hand-off costs (default: the built-in model measured on "
                   "the tiny model here, simulator/tiny_cpu.json)")
    g.add_argument("--fit-from", default=None, metavar="TIMELINE.json",
                   help="fit the step costs to a measured run's timeline "
                   "(bench serve --timeline FILE.png writes FILE.json)")
    g.add_argument("--save-cost-model", default=None, metavar="FILE")
    g.add_argument("--trace", default=None, metavar="FILE.json",
                   help="requests from a trace of (arrival_s, prompt_tokens, output_tokens) "
                   "instead of a dataset")
    g.add_argument("--progress-every", type=float, default=60.0, metavar="S",
                   help="progress to stderr every S simulated seconds")
    g.add_argument("--summary-only", action="store_true",
                   help="leave the per-request lists out of the JSON")
    add_dataset_args(p)
    add_load_args(p)
    p.add_argument("--result-file", default=DEFAULT_RESULT)
    p.add_argument("--label", default="")
    # lazy: `import pdserve.cli` stays light: the planner's arguments load with the parser
    from pdserve.simulator.plan import add_plan_args

    add_plan_args(p)


def sim_config(args: argparse.Namespace):
    # lazy: simulator.cluster (numpy, the router's routing) loads only when simulate runs
    from pdserve.simulator.cluster import SimConfig

    engine = {"enable_prefix_caching": not args.no_prefix_caching}
    for name in ("max_num_seqs", "num_kv_blocks", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    return SimConfig(mode=args.mode, prefill=args.prefill, decode=args.decode,
                     replicas=args.replicas, engine=engine, routing=args.routing,
                     kv_streaming=not args.no_kv_streaming,
                     max_concurrency=args.max_concurrency)


def cost_model(args: argparse.Namespace):
    # lazy: `import pdserve.cli` stays light: the cost model loads only when simulate runs
    from pdserve.simulator.calibrate import fit_timeline
    from pdserve.simulator.cost_model import CostModel

    costs = CostModel.load(args.cost_model)
    if args.fit_from:
        costs = fit_timeline(args.fit_from, costs)
    if args.save_cost_model:
        costs.save(args.save_cost_model)
    return costs


def run(args: argparse.Namespace) -> int:
    # lazy: `import pdserve.cli` stays light: the simulator loads only when simulate runs
    from pdserve.bench.serve import load_kwargs, parse_floats
    from pdserve.bench.serve_report import write_json
    from pdserve.simulator.cluster import Cluster
    from pdserve.simulator.metrics import format_summary, simulated_summary
    from pdserve.simulator.workload import workload_of

    try:
        config = sim_config(args)
        costs = cost_model(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.plan:
        # lazy: `import pdserve.cli` stays light: the simulator loads only when simulate runs
        from pdserve.simulator.plan import run_plan

        return run_plan(args, config, costs)
    kw = load_kwargs(args)
    load = workload_of(args)
    sim = Cluster(config, costs).run(load, progress=not args.disable_tqdm,
                                     tick_s=args.progress_every)
    r = simulated_summary(sim, label=args.label, request_rate=load.request_rate,
                          burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                          seed=args.seed, slos=kw["slos"],
                          percentiles=parse_floats(args.metric_percentiles),
                          summary_only=args.summary_only)
    r["dataset_name"] = "trace" if args.trace else args.dataset_name
    r["cost_model"] = str(args.fit_from or args.cost_model or "built-in")
    print(format_summary(r), flush=True)
    st = sim.stats
    print(f"simulated {sim.num_requests:,} requests on "
          + ", ".join(f"{n} x{p['ranks']}" for n, p in st["pools"].items())
          + f" in {st['wall_s']:.1f}s wall ({st['virtual_s']:.1f}s virtual, "
          f"{st['events']:,} events)", flush=True)
    write_json(args.result_file, r)
    print(f"wrote {Path(args.result_file)}", flush=True)
    return 0


def register_commands(register) -> None:
    register("simulate", "simulate a cluster on virtual time (the real scheduler, fitted "
             "step costs); bench serve's metrics", add_args, run)


__all__ = ["add_args", "register_commands", "run"]
