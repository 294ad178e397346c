"""Two builds of pdserve side by side: the same deployment and workload, one run.

    python bench/compare_builds.py --before-python /path/to/other/venv/bin/python
    python bench/compare_builds.py --before-python OLD --rounds 3 --num-prompts 40

Each build serves through `pdserve serve` started by its own interpreter (so each has
its own embedded Ray and its own code: point `--before-python` at a venv whose pdserve
is the other checkout); both are up at once and the seeded workload of `bench serve`
runs against them in alternating order (`--rounds`), so a noisy neighbour hits both
alike. Prints the side by side table with after / before ratios and writes JSON.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.bench.compare_modes import DEPLOYMENTS, compare, format_comparison
from pdserve.bench.routers import subprocess_router
from pdserve.bench.serve import add_dataset_args, add_load_args, build_requests, load_kwargs
from pdserve.bench.serve_report import write_json
from pdserve.engine.model.catalog import resolve_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_dataset_args(p)
    add_load_args(p)
    p.add_argument("--result-file", default="results/bench_compare_builds.json")
    p.add_argument("--before-python", required=True, help="interpreter of the other build")
    p.add_argument("--after-python", default=sys.executable)
    p.add_argument("--mode", choices=sorted(DEPLOYMENTS), default="disaggregated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-transport", choices=["ray", "grpc"], default="ray")
    args = p.parse_args(argv)
    args.model = resolve_model(args.model).path
    requests = build_requests(args)
    kwargs = load_kwargs(args)
    kwargs["request_rate"] = args.request_rate
    spec = DEPLOYMENTS[args.mode]
    launchers = {
        name: subprocess_router(spec, model=args.model, kv_transport=args.kv_transport,
                                python=python)
        for name, python in (("before", args.before_python), ("after", args.after_python))}
    out = compare(launchers, requests, rounds=args.rounds, **kwargs)
    out["comparison"] = {part: {k: {**row, **({"ratio_after/before": row["after"] / row["before"]}
                                              if row.get("after") is not None and row.get("before")
                                              else {})}
                                for k, row in table.items()}
                         for part, table in out["comparison"].items()}
    print(format_comparison(out["comparison"]))
    out["builds"] = {"before": args.before_python, "after": args.after_python}
    write_json(args.result_file, out)
    print(f"wrote {args.result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
