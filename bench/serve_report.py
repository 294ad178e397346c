"""`bench serve`'s results: the result dict of a workload's runs (`summarize`, field
names those of `vllm bench serve`), its printed summary table, and the files written
beside it (JSON, and the run's step and pool timelines as PNGs).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from datetime import datetime
from pathlib import Path

import grpc

from pdserve.bench.load_timeline import pool_timeline
from pdserve.bench.plots import plot_pool_timeline, plot_timeline
from pdserve.bench.serve_client import Run, collect, fetch_timeline
from pdserve.bench.serve_metrics import (
    DEFAULT_PERCENTILES,
    breakdown_summary,
    calculate_metrics,
    metrics_by_kind,
    per_request_lists,
)


async def run_benchmark(address: str, requests: list, **kwargs) -> dict:
    """`collect` then `summarize` (their keyword arguments): one run's result dict."""
    if not requests:
        raise ValueError("no requests to send")
    collect_kw = {k: v for k, v in kwargs.items()
                  if k not in ("slos", "percentiles", "rate_schedule")}
    run = await collect(address, requests, **collect_kw)
    return summarize([run], address=address, **kwargs)


# ---- command line ----------------------------------------------------------------------

def summarize(runs: list[Run], *, address: str = "", label: str = "",
              request_rate: float = math.inf, burstiness: float = 1.0,
              max_concurrency: int | None = None, seed: int = 0,
              slos: dict[str, float] | None = None, percentiles=None,
              temperature: float = 0.0, ignore_eos: bool = True, rate_schedule=None,
              **_ignored) -> dict:
    """The result dict of one or more runs of the same workload: metrics over all their
    requests, duration the sum of theirs; per-request lists in run order; with a sampled
    run, its `pool_timeline` (load_timeline.py; `rate_schedule`: the load it followed)."""
    percentiles = tuple(percentiles or DEFAULT_PERCENTILES)
    records = [r for run in runs for r in run.records]
    duration = sum(run.duration for run in runs)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "pdserve",
        "label": label,
        "address": address,
        "num_prompts": len(records),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "seed": seed,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "percentiles": list(percentiles),
        "num_runs": len(runs),
    }
    result.update(calculate_metrics(records, duration, slos, percentiles))
    result["by_kind"] = metrics_by_kind(records, duration, slos, percentiles)
    result["ttft_breakdown"] = breakdown_summary(records, percentiles)
    result["start_unix_s"] = runs[0].wall_start if runs else None
    # The server's own counts, beside the client's (input_lens / output_lens).
    result["usage_prompt_tokens"] = [r.usage_prompt_tokens for r in records]
    result["usage_completion_tokens"] = [r.usage_completion_tokens for r in records]
    result["usage_cached_tokens"] = [r.usage_cached_tokens for r in records]
    result["prefix_cache_hit_rate"] = _hit_rate(records)
    kinds = sorted({r.kind for r in records})
    result["prefix_cache_hit_rate_by_kind"] = {
        k: _hit_rate([r for r in records if r.kind == k]) for k in kinds}
    lists: dict = {}
    for run in runs:  # send offsets relative to each run's own start
        for key, values in per_request_lists(run.records, run.start).items():
            lists.setdefault(key, []).extend(values)
    result.update(lists)
    result["cluster"] = runs[-1].after or runs[-1].before if runs else None
    deltas: dict = {}
    for run in runs:
        for rank, c in (_counter_deltas(run.before, run.after) or {}).items():
            acc = deltas.setdefault(rank, {})
            for k, v in c.items():
                acc[k] = acc.get(k, 0) + v
    result["rank_step_deltas"] = deltas or None
    if runs and runs[-1].sampler is not None:
        result["rate_schedule"] = rate_schedule.describe() if rate_schedule else None
        result["pool_timeline"] = pool_timeline(runs[-1], slos=slos, schedule=rate_schedule)
    return result


def _counter_deltas(before: dict | None, after: dict | None) -> dict | None:
    if not before or not after:
        return None
    out = {}
    for rank, c in after["counters"].items():
        b = before["counters"].get(rank, {})
        out[rank] = {k: v - b.get(k, 0) for k, v in c.items()}
    return out


def _hit_rate(records: list) -> float | None:
    """Prompt tokens the server reported cached / prompt tokens, successful requests."""
    done = [r for r in records if r.success and r.usage_cached_tokens is not None]
    total = sum(r.prompt_len for r in done)
    return sum(r.usage_cached_tokens for r in done) / total if total else None


def format_summary(r: dict) -> str:
    """The vLLM-style summary table."""
    lines = [f"{' Serving Benchmark Result ' + (r.get('label') or ''):=^60}"]

    def row(name, value, fmt="{:<40} {:<10.2f}"):
        lines.append(fmt.format(name, value) if value is not None else f"{name:<40} n/a")

    row("Successful requests:", r["completed"], "{:<40} {:<10}")
    row("Failed requests:", r["failed"], "{:<40} {:<10}")
    row("Request rate configured (RPS):", r["request_rate"], "{:<40} {:<10}")
    row("Benchmark duration (s):", r["duration"])
    row("Total input tokens:", r["total_input_tokens"], "{:<40} {:<10}")
    row("Total generated tokens:", r["total_output_tokens"], "{:<40} {:<10}")
    row("Request throughput (req/s):", r["request_throughput"])
    if r.get("request_goodput") is not None:
        row("Request goodput (req/s):", r["request_goodput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{title:-^60}")
        row(f"Mean {key.upper()} (ms):", r[f"mean_{key}_ms"])
        row(f"Median {key.upper()} (ms):", r[f"median_{key}_ms"])
        for p in r["percentiles"]:
            if p == 50:
                continue  # the median, just above
            label = str(int(p)) if float(p).is_integer() else str(p)
            row(f"P{label} {key.upper()} (ms):", r[f"p{label}_{key}_ms"])
    b = r.get("ttft_breakdown")
    if b:
        lines.append(f"{'Server-side timings (ms; mean / median / p99)':-^60}")
        p = "p99" if "p99" in b["client_ttft_ms"] else list(b["client_ttft_ms"])[-1]
        for key, name in (("router_queue_ms", "router queue"), ("prefill_queue_ms", "prefill queue"),
                          ("prefill_ms", "prefill"), ("kv_export_ms", "KV export"),
                          ("transit_ms", "transit (Ray calls, polls)"),
                          ("ttft_ms", "= TTFT at the router"), ("client_ttft_ms", "TTFT at the client"),
                          ("kv_handoff_ms", "after token 1: KV hand-off"),
                          ("decode_queue_ms", "after token 1: decode queue")):
            v = b[key]
            lines.append(f"{name + ':':<34} {v['mean']:>8.2f} {v['median']:>8.2f} {v[p]:>8.2f}")
        lines.append(f"{'KV bytes per hand-off (mean):':<34} {b['kv_bytes']['mean']:>8.0f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def write_timeline(address: str, since: float, png: str,
                   client_options: dict | None = None) -> None:
    """The run's step records (JSON beside the PNG) and their picture; a router that
    cannot give them costs the picture, not the run's results."""
    try:
        steps = asyncio.run(fetch_timeline(address, since, client_options))
    except grpc.RpcError as exc:
        print(f"no timeline: the router's GetTimeline failed ({exc.code().name}: "
              f"{exc.details()})", file=sys.stderr)
        return
    write_json(Path(png).with_suffix(".json"), {"since_unix_s": since, "steps": steps})
    if not steps:
        print("no timeline: the ranks kept no steps of this run", file=sys.stderr)
        return
    plot_timeline(steps, png)
    print(f"wrote {png} ({len(steps)} steps)", flush=True)


def pool_timeline_png(png: str | Path) -> Path:
    """Where --timeline FILE.png draws the pools: FILE_pools.png."""
    png = Path(png)
    return png.with_name(png.stem + "_pools.png")


def write_pool_timeline(results: list[dict], png: str) -> None:
    """Replicas per pool, load and SLO attainment of the (first sampled) run."""
    sampled = [r for r in results if (r.get("pool_timeline") or {}).get("samples")]
    if not sampled:
        print("no pool timeline: no cluster state could be sampled", file=sys.stderr)
        return
    out = plot_pool_timeline(sampled[0]["pool_timeline"], pool_timeline_png(png),
                             title=sampled[0].get("label") or "")
    print(f"wrote {out} ({len(sampled[0]['pool_timeline']['samples'])} samples)", flush=True)
