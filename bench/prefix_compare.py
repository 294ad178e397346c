"""`pdserve bench serve --dataset-name prefix --compare-caching`: the same prefix
workload against three deployments brought up in turn (`pdserve serve` subprocesses,
disaggregated, 2 prefill ranks + 1 decode rank): prefix caching off; caching on with
least-loaded routing; caching on with cache-aware routing. Reported side by side from
one run: the prefix-cache hit rate (prompt tokens the server reported cached / prompt
tokens), overall and per request kind, and TTFT (median, p99) per kind, with the ratio
of cold to shared-prefix median TTFT. Writes JSON.
"""

from __future__ import annotations

import asyncio
import sys

from pdserve.bench.datasets import random_requests
from pdserve.bench.routers import subprocess_router
from pdserve.bench.serve_report import run_benchmark, write_json

DEPLOYMENT = {"mode": "disaggregated", "prefill": 2, "decode": 1}
CONFIGS = (
    ("caching off", ("--no-prefix-caching", "--routing", "least_loaded")),
    ("caching, least-loaded", ("--routing", "least_loaded")),
    ("caching, cache-aware", ("--routing", "cache_aware")),
)
KINDS = ("first", "shared", "cold", "turn")


def run(args, requests: list, kwargs: dict) -> dict:
    kwargs = {k: v for k, v in kwargs.items() if k != "client_options"}
    warm = random_requests(4, 64, 4, vocab_size=1000, seed=12345)  # nothing shared with them
    results = {}
    for name, extra in CONFIGS:
        with subprocess_router(DEPLOYMENT, model=args.model, extra_args=extra) as address:
            asyncio.run(run_benchmark(address, warm, num_warmups=0, progress=False))
            results[name] = asyncio.run(run_benchmark(
                address, requests, request_rate=args.request_rate, num_warmups=0, label=name,
                **kwargs))
        print(f"[{name}] done: hit rate {_pct(results[name]['prefix_cache_hit_rate'])}",
              file=sys.stderr, flush=True)
    table = {name: summary(r) for name, r in results.items()}
    print(format_table(table), flush=True)
    write_json(args.result_file, {"compare_caching": table, "deployment": DEPLOYMENT,
                                  "runs": results})
    print(f"wrote {args.result_file}", flush=True)
    return table


def summary(r: dict) -> dict:
    by_kind = r.get("by_kind") or {}
    row = {"hit_rate": r["prefix_cache_hit_rate"],
           "hit_rate_by_kind": r["prefix_cache_hit_rate_by_kind"],
           "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
           "failed": r["failed"]}
    for kind in KINDS:
        if kind in by_kind:
            row[f"{kind}_median_ttft_ms"] = by_kind[kind]["median_ttft_ms"]
            row[f"{kind}_p99_ttft_ms"] = by_kind[kind]["p99_ttft_ms"]
    if row.get("shared_median_ttft_ms"):
        row["cold_over_shared_median_ttft"] = (row.get("cold_median_ttft_ms", 0.0)
                                               / row["shared_median_ttft_ms"])
    return row


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ttft(row: dict, kind: str) -> str:
    med, p99 = row.get(f"{kind}_median_ttft_ms"), row.get(f"{kind}_p99_ttft_ms")
    return "n/a" if med is None else f"{med:.0f}/{p99:.0f}"


def format_table(table: dict) -> str:
    head = (f"{'':24s} {'hit rate':>9s} {'shared':>8s} {'turn':>8s} | TTFT ms p50/p99: "
            f"{'all':>11s} {'first':>11s} {'shared':>11s} {'turn':>11s} {'cold':>11s} | "
            "cold/shared p50")
    lines = [head]
    for name, row in table.items():
        kinds = row["hit_rate_by_kind"]
        ratio = row.get("cold_over_shared_median_ttft")
        overall = f"{row['median_ttft_ms']:.0f}/{row['p99_ttft_ms']:.0f}"
        lines.append(
            f"{name:24s} {_pct(row['hit_rate']):>9s} {_pct(kinds.get('shared')):>8s} "
            f"{_pct(kinds.get('turn')):>8s} | {'':16s} {overall:>11s} "
            + " ".join(f"{_ttft(row, k):>11s}" for k in KINDS[:1] + ("shared", "turn", "cold"))
            + " | " + ("n/a" if ratio is None else f"{ratio:.2f}x"))
    return "\n".join(lines)
