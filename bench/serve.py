"""Serving benchmark: a load generator against a running pdserve router.

    pdserve serve &                                     # a router on 127.0.0.1:50051
    pdserve bench serve --num-prompts 50 --request-rate 4 --goodput ttft:500 tpot:100
    pdserve bench serve --dataset-name mixed --sweep-rates 1,2,4,inf

Requests follow a seeded dataset (`datasets.py`) and a gamma/Poisson arrival process;
each is sent with `ignore_eos` and `max_tokens` = its output length, greedy by default,
so output lengths are controlled. Every time is measured by this client with
`time.perf_counter()` (conventions in `serve_metrics.py`). Writes JSON whose field
names are those of `vllm bench serve` (plus per-request lists and pdserve extras) and
a PNG of the latency CDFs (or, with --sweep-rates, of throughput and latency against
the request rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_RESULT = "results/bench_serve.json"


# ---- running ---------------------------------------------------------------------------

async def _stream_one(client, req, rec, *, temperature: float, ignore_eos: bool,
                      timeout: float | None) -> None:
    """Send one request and record, as messages arrive, what the client sees."""
    import grpc

    rec.send_time = time.perf_counter()
    try:
        async for msg in client.stream(req.prompt, max_tokens=req.output_len,
                                       temperature=temperature, ignore_eos=ignore_eos,
                                       timeout=timeout):
            now = time.perf_counter()
            rec.record_message(now, len(msg.token_ids))
            if msg.request_id:
                rec.request_id = msg.request_id
            if msg.finish_reason:
                rec.end_time = now
                rec.finish_reason = msg.finish_reason
                rec.error = msg.error
                rec.usage_prompt_tokens = msg.usage.prompt_tokens
                rec.usage_completion_tokens = msg.usage.completion_tokens
                rec.usage_cached_tokens = getattr(msg.usage, "cached_prompt_tokens", 0)
                rec.breakdown = _breakdown(msg)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        rec.error = f"{getattr(code, 'name', 'RPC_ERROR')}: {exc.details() if hasattr(exc, 'details') else exc}"
    except Exception as exc:  # anything else is the request's error, not the run's
        rec.error = f"{type(exc).__name__}: {exc}"
    if not rec.finish_reason and not rec.error:
        rec.error = "the stream ended without a finish_reason"
    if rec.finish_reason == "error" and not rec.error:
        rec.error = "finish_reason error"


def _breakdown(msg) -> dict | None:
    """The router's per-request TTFT breakdown: the `timings` field of the last
    GenerateResponse as a dict of every field (ms; kv_bytes an int), or None."""
    try:
        if not msg.HasField("timings"):
            return None
    except ValueError:  # no such field in this proto
        return None
    t = msg.timings
    return {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields}


async def fetch_timeline(address: str, since: float,
                         client_options: dict | None = None) -> list[dict]:
    """The router's step records of every live rank since unix time `since`."""
    from pdserve.router.client import AsyncClient

    async with AsyncClient(address, timeout=60, **(client_options or {})) as client:
        return await client.timeline(since)


def _write_timeline(address: str, since: float, png: str,
                    client_options: dict | None = None) -> None:
    """The run's step records (JSON beside the PNG) and their picture; a router that
    cannot give them costs the picture, not the run's results."""
    import grpc

    from pdserve.bench.plots import plot_timeline

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


def _write_pool_timeline(results: list[dict], png: str) -> None:
    """Replicas per pool, load and SLO attainment of the (first sampled) run."""
    from pdserve.bench.plots import plot_pool_timeline

    sampled = [r for r in results if (r.get("pool_timeline") or {}).get("samples")]
    if not sampled:
        print("no pool timeline: no cluster state could be sampled", file=sys.stderr)
        return
    out = plot_pool_timeline(sampled[0]["pool_timeline"], pool_timeline_png(png),
                             title=sampled[0].get("label") or "")
    print(f"wrote {out} ({len(sampled[0]['pool_timeline']['samples'])} samples)", flush=True)


def _rank_counters(state) -> dict:
    """Per-rank step counters from GetClusterState (for before/after deltas)."""
    out = {}
    for pool in state.pools:
        for r in pool.ranks:
            out[f"{pool.name}/{r.rank}"] = {"num_steps": int(r.num_steps),
                                            "num_empty_steps": int(r.num_empty_steps),
                                            "num_preemptions": int(r.num_preemptions)}
    return out


async def _cluster_info(client) -> dict | None:
    try:
        state = await client.cluster_state()
    except Exception:
        return None
    return {"mode": state.mode, "model": state.model, "kv_transport": state.kv_transport,
            "pools": {p.name: len(p.ranks) for p in state.pools},
            "counters": _rank_counters(state)}


def _counter_deltas(before: dict | None, after: dict | None) -> dict | None:
    if not before or not after:
        return None
    out = {}
    for rank, c in after["counters"].items():
        b = before["counters"].get(rank, {})
        out[rank] = {k: v - b.get(k, 0) for k, v in c.items()}
    return out


@dataclass
class Run:
    """One pass of a workload over a router: the client's records and the clocks."""

    records: list
    start: float
    duration: float
    before: dict | None = None  # GetClusterState before and after (step counters)
    after: dict | None = None
    wall_start: float = 0.0  # time.time() at `start` (to ask the ranks for their steps)
    sampler: object = None  # load_timeline.PoolSampler, when the pools were sampled


async def collect(address: str, requests: list, *, request_rate: float = math.inf,
                  burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                  temperature: float = 0.0, ignore_eos: bool = True,
                  request_timeout: float | None = None, num_warmups: int = 1,
                  progress: bool = True, client=None, label: str = "",
                  client_options: dict | None = None, offsets: list[float] | None = None,
                  hold_s: float = 0.0, sample_interval_s: float | None = None) -> Run:
    """Send `requests` (datasets.SampleRequest) on their arrival schedule; record each.

    `client` is anything with AsyncClient's `stream(prompt, **kw)` (and, optionally,
    `cluster_state()`); by default an AsyncClient on `address` (with `client_options`:
    token, TLS), closed at the end. `offsets` (send times, e.g. a rate schedule's)
    replace the rate's arrival process; the run lasts `hold_s` at least; with
    `sample_interval_s` a `PoolSampler` records the pools meanwhile (`Run.sampler`).
    """
    from tqdm import tqdm

    from pdserve.bench.datasets import arrival_offsets
    from pdserve.bench.serve_metrics import RequestRecord

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    own_client = client is None
    if own_client:
        from pdserve.router.client import AsyncClient

        client = AsyncClient(address, **(client_options or {}))
    try:
        for i in range(num_warmups):  # not timed: connects, warms the ranks
            req = requests[i % len(requests)]
            warm = RequestRecord(prompt_len=req.prompt_len)
            await _stream_one(client, type(req)(req.prompt, req.prompt_len, min(4, req.output_len)),
                              warm, temperature=temperature, ignore_eos=ignore_eos,
                              timeout=request_timeout or 300)
            if not warm.success:
                raise RuntimeError(f"warm-up request to {address} failed: {warm.error}")
        before = await _cluster_info(client) if hasattr(client, "cluster_state") else None

        if offsets is None:
            offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
        elif len(offsets) != len(requests):
            raise ValueError(f"{len(offsets)} send times for {len(requests)} requests")
        sampler = None
        if sample_interval_s is not None and hasattr(client, "cluster_state"):
            from pdserve.bench.load_timeline import PoolSampler

            sampler = PoolSampler(client, sample_interval_s)
        records = [RequestRecord(prompt_len=r.prompt_len, expected_output_len=r.output_len,
                                 kind=r.kind) for r in requests]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), disable=not progress, desc=label or "requests",
                   file=sys.stderr, leave=False)

        done = [asyncio.Event() for _ in requests]

        async def one(i: int) -> None:
            rec = records[i]
            rec.scheduled_time = start + offsets[i]
            delay = rec.scheduled_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            after = getattr(requests[i], "after", None)
            if after is not None:  # a conversation's next turn: once the last one ended
                await done[after].wait()
                rec.scheduled_time = max(rec.scheduled_time, time.perf_counter())
            try:
                if sem is None:
                    await _stream_one(client, requests[i], rec, temperature=temperature,
                                      ignore_eos=ignore_eos, timeout=request_timeout)
                else:
                    async with sem:
                        await _stream_one(client, requests[i], rec, temperature=temperature,
                                          ignore_eos=ignore_eos, timeout=request_timeout)
            finally:
                done[i].set()
            bar.update(1)

        wall_start, start = time.time(), time.perf_counter()
        if sampler is not None:
            sampler.start(start)
        try:
            await asyncio.gather(*(one(i) for i in range(len(requests))))
            duration = time.perf_counter() - start
            bar.close()
            rest = hold_s - (time.perf_counter() - start)
            if rest > 0:  # the schedule's quiet end: the pools settle, the sampler watches
                print(f"load done; watching the pools for {rest:.0f} s more", file=sys.stderr)
                await asyncio.sleep(rest)
        finally:
            if sampler is not None:
                await sampler.stop()
        after = await _cluster_info(client) if hasattr(client, "cluster_state") else None
    finally:
        if own_client:
            await client.close()
    return Run(records, start, duration, before, after, wall_start, sampler)


def summarize(runs: list[Run], *, address: str = "", label: str = "",
              request_rate: float = math.inf, burstiness: float = 1.0,
              max_concurrency: int | None = None, seed: int = 0,
              slos: dict[str, float] | None = None, percentiles=None,
              temperature: float = 0.0, ignore_eos: bool = True, rate_schedule=None,
              **_ignored) -> dict:
    """The result dict of one or more runs of the same workload: metrics over all their
    requests, duration the sum of theirs; per-request lists in run order; with a sampled
    run, its `pool_timeline` (load_timeline.py; `rate_schedule`: the load it followed)."""
    from pdserve.bench.serve_metrics import (
        DEFAULT_PERCENTILES,
        breakdown_summary,
        calculate_metrics,
        metrics_by_kind,
        per_request_lists,
    )

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
        from pdserve.bench.load_timeline import pool_timeline

        result["rate_schedule"] = rate_schedule.describe() if rate_schedule else None
        result["pool_timeline"] = pool_timeline(runs[-1], slos=slos, schedule=rate_schedule)
    return result


def _hit_rate(records: list) -> float | None:
    """Prompt tokens the server reported cached / prompt tokens, successful requests."""
    done = [r for r in records if r.success and r.usage_cached_tokens is not None]
    total = sum(r.prompt_len for r in done)
    return sum(r.usage_cached_tokens for r in done) / total if total else None


async def run_benchmark(address: str, requests: list, **kwargs) -> dict:
    """`collect` then `summarize` (their keyword arguments): one run's result dict."""
    if not requests:
        raise ValueError("no requests to send")
    collect_kw = {k: v for k, v in kwargs.items()
                  if k not in ("slos", "percentiles", "rate_schedule")}
    run = await collect(address, requests, **collect_kw)
    return summarize([run], address=address, **kwargs)


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


# ---- command line ----------------------------------------------------------------------

def parse_floats(text: str) -> list[float]:
    """``"50,90 99"`` -> ``[50.0, 90.0, 99.0]`` (commas or spaces)."""
    return [float(x) for x in str(text).replace(",", " ").split()]


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=["random", "mixed", "prefix", "chat"],
                   default="random",
                   help="prefix: shared system prompts, cold prompts of their length and "
                   "multi-turn conversations (bench/datasets.py)")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--seed", type=int, default=0, help="dataset and arrival seed")
    g.add_argument("--random-input-len", type=int, default=128)
    g.add_argument("--random-output-len", type=int, default=32)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (also for mixed)")
    g.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="random prompts as token ids (exact lengths) or decoded text")
    g.add_argument("--mixed-long-ratio", type=float, default=0.1,
                   help="share of long prompts in the mixed workload")
    g.add_argument("--mixed-long-input-len", type=int, default=1024)
    g.add_argument("--mixed-long-output-len", type=int, default=8)
    g.add_argument("--mixed-short-input-len", type=int, default=64)
    g.add_argument("--mixed-short-output-len", type=int, default=64)
    g.add_argument("--prefix-system-len", type=int, default=1024,
                   help="prefix: tokens of each shared system prompt (cold prompts: the same "
                   "plus a question)")
    g.add_argument("--prefix-num-system-prompts", type=int, default=2)
    g.add_argument("--prefix-question-len", type=int, default=32)
    g.add_argument("--prefix-turns", type=int, default=4, help="prefix: turns per conversation")
    g.add_argument("--prefix-turn-len", type=int, default=64,
                   help="prefix: new user tokens per turn (the reply re-sent is --random-"
                   "output-len long)")
    g.add_argument("--model", default=None,
                   help="model folder, for the vocabulary and tokenizer (default: the "
                   "built-in tiny model's folder that `pdserve serve` uses)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="token ids of random prompts stay below this (default: the model's)")


def add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (default inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times (1: Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:5000")
    g.add_argument("--metric-percentiles", default="50,90,99")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="let EOS end requests early (output lengths then vary)")
    g.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    g.add_argument("--num-warmups", type=int, default=1)
    g.add_argument("--disable-tqdm", action="store_true")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from pdserve.router.cli_commands import add_client_args

    add_client_args(p)  # --address, --token-file, --tls-ca-file, --tls-server-name
    add_dataset_args(p)
    add_load_args(p)
    p.add_argument("--sweep-rates", default=None,
                   help="run once per rate (e.g. 1,2,4,inf) and plot against the rate")
    p.add_argument("--rate-schedule", default=None, metavar="SECONDS:RATE,...",
                   help="a load that steps up and down, e.g. 60:1,120:6,180:0 (requests per "
                   "second for so many seconds; 0: none); the count of requests is the "
                   "schedule's, not --num-prompts'; the pools are sampled (pool_timeline)")
    p.add_argument("--sample-interval", type=float, default=1.0, metavar="SECONDS",
                   help="with --rate-schedule or --timeline: seconds between samples of the "
                   "pools (default %(default)s)")
    p.add_argument("--result-file", default=DEFAULT_RESULT, help="JSON out (default %(default)s)")
    p.add_argument("--plot", default=None, help="PNG out (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--timeline", default=None, metavar="FILE.png",
                   help="also draw the run's engine steps per rank (their records go to "
                   "FILE.json) and, in FILE_pools.png, ranks per pool, load and SLO "
                   "attainment over time")
    p.add_argument("--label", default="")
    p.add_argument("--compare-caching", action="store_true",
                   help="bring up 3 deployments in turn (2 prefill + 1 decode ranks): prefix "
                   "caching off, on with least-loaded routing, on with cache-aware routing; "
                   "the same workload on each, compared in one table (bench/prefix_compare.py)")
    p.add_argument("--backend", choices=["pdserve", "openai"], default="pdserve",
                   help="pdserve: the router's gRPC API (--address); openai: any "
                   "OpenAI-compatible server's /v1/completions (--base-url)")
    p.add_argument("--base-url", default=None,
                   help="--backend openai: e.g. http://127.0.0.1:50053/v1 (pdserve's HTTP "
                   "front) or http://127.0.0.1:8000/v1 (vLLM)")
    p.add_argument("--served-model-name", default=None,
                   help="--backend openai: the `model` to ask for (default: the server's "
                   "first /v1/models entry)")


def model_info(args: argparse.Namespace) -> tuple[int, object]:
    """(vocab size, tokenizer or None) for building prompts."""
    model = args.model
    tokenizer = None
    vocab = args.vocab_size
    if args.prompt_format == "text" or vocab is None:
        from pdserve.engine.model_catalog import ModelError, resolve_model

        try:
            model = resolve_model(model).path
        except ModelError as exc:
            raise SystemExit(f"error: {exc} (pass --model PATH, or --vocab-size N with "
                             "--prompt-format ids)") from None
        if vocab is None:
            from pdserve.engine.model_config import ModelConfig

            vocab = ModelConfig.from_model(model).vocab_size
        if args.prompt_format == "text":
            from pdserve.engine.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_model(model)
    return vocab, tokenizer


def build_requests(args: argparse.Namespace) -> list:
    from pdserve.bench.datasets import mixed_requests, random_requests

    if args.num_prompts < 1:
        raise SystemExit("error: --num-prompts must be >= 1")
    vocab, tokenizer = model_info(args)
    common = dict(vocab_size=vocab, range_ratio=args.random_range_ratio, seed=args.seed,
                  prompt_format=args.prompt_format, tokenizer=tokenizer)
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               **common)
    if args.dataset_name == "chat":
        from pdserve.bench.datasets import chat_requests
        from pdserve.engine.model_catalog import resolve_model
        from pdserve.router.chat_template import ChatTemplate

        template = ChatTemplate.from_model_dir(resolve_model(args.model).path)
        if tokenizer is None:
            from pdserve.engine.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_model(resolve_model(args.model).path)
        return chat_requests(args.num_prompts, args.random_output_len, chat_template=template,
                             tokenizer=tokenizer, seed=args.seed,
                             prompt_format=args.prompt_format)
    if args.dataset_name == "prefix":
        from pdserve.bench.datasets import prefix_requests

        return prefix_requests(args.num_prompts, vocab_size=vocab, seed=args.seed,
                               system_len=args.prefix_system_len,
                               question_len=args.prefix_question_len,
                               num_system_prompts=args.prefix_num_system_prompts,
                               turns=args.prefix_turns, turn_len=args.prefix_turn_len,
                               output_len=args.random_output_len)
    return mixed_requests(args.num_prompts, long_ratio=args.mixed_long_ratio,
                          long_input_len=args.mixed_long_input_len,
                          long_output_len=args.mixed_long_output_len,
                          short_input_len=args.mixed_short_input_len,
                          short_output_len=args.mixed_short_output_len, **common)


def load_kwargs(args: argparse.Namespace) -> dict:
    from pdserve.bench.serve_metrics import parse_goodput

    try:
        slos = parse_goodput(args.goodput)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return dict(burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                seed=args.seed, slos=slos, percentiles=parse_floats(args.metric_percentiles),
                temperature=args.temperature, ignore_eos=not args.no_ignore_eos,
                request_timeout=args.request_timeout, progress=not args.disable_tqdm)


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _rate_schedule(args: argparse.Namespace):
    """The parsed --rate-schedule (None without one); sets --num-prompts to its count."""
    if not args.rate_schedule:
        return None, None
    from pdserve.bench.load_timeline import RateSchedule

    for flag, clash in (("--sweep-rates", args.sweep_rates),
                        ("--request-rate", math.isfinite(args.request_rate)),
                        ("--compare-caching", args.compare_caching)):
        if clash:
            raise SystemExit(f"error: --rate-schedule sets the rate; drop {flag}")
    try:
        schedule = RateSchedule.parse(args.rate_schedule)
        offsets = schedule.offsets(args.burstiness, args.seed)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if not offsets:
        raise SystemExit(f"error: --rate-schedule {args.rate_schedule} drew no request")
    args.num_prompts = len(offsets)
    print(f"rate schedule: {schedule.describe()}: {len(offsets)} requests over "
          f"{schedule.total_s:g} s", file=sys.stderr)
    return schedule, offsets


def run_serve(args: argparse.Namespace) -> int:
    from pdserve.router.cli_commands import client_options

    schedule, offsets = _rate_schedule(args)
    requests = build_requests(args)
    kwargs = load_kwargs(args)
    if schedule is not None:
        kwargs.update(offsets=offsets, hold_s=schedule.total_s, rate_schedule=schedule)
    if schedule is not None or args.timeline:
        from pdserve.bench.load_timeline import checked_interval

        try:
            kwargs["sample_interval_s"] = checked_interval(args.sample_interval)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        kwargs["client_options"] = client_options(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.backend == "openai":
        if not args.base_url:
            print("error: --backend openai needs --base-url", file=sys.stderr)
            return 2
        if args.timeline:
            print("error: --timeline needs the pdserve backend (the router's GetTimeline)",
                  file=sys.stderr)
            return 2

    async def bench_once(requests, **kw) -> dict:  # one run, with a client of its own
        if args.backend != "openai":
            return await run_benchmark(args.address, requests, **kw)
        from pdserve.bench.openai_backend import OpenAIBackend

        backend = OpenAIBackend(args.base_url, args.served_model_name,
                                kw.pop("client_options")["token"])
        try:
            return await run_benchmark(args.base_url, requests, client=backend, **kw)
        finally:
            await backend.close()

    if args.compare_caching:
        from pdserve.bench import prefix_compare

        prefix_compare.run(args, requests, kwargs)
        return 0
    dataset = {"dataset_name": args.dataset_name, "prompt_format": args.prompt_format}
    plot = None if args.no_plot else (args.plot or str(Path(args.result_file).with_suffix(".png")))
    try:
        if args.sweep_rates:
            rates = parse_floats(args.sweep_rates)
            runs = []
            for i, rate in enumerate(rates):
                r = asyncio.run(bench_once(requests, request_rate=rate,
                                              num_warmups=args.num_warmups if i == 0 else 0,
                                              label=f"rate {rate:g}", **kwargs))
                r.update(dataset)
                print(format_summary(r), flush=True)
                runs.append(r)
            out = {"sweep_rates": [r["request_rate"] for r in runs], "runs": runs, **dataset}
            write_json(args.result_file, out)
            if plot:
                from pdserve.bench.plots import plot_cdfs, plot_sweep

                plot_sweep(runs, plot)
                plot_cdfs({f"rate {r['request_rate']}": r for r in runs},
                          str(Path(plot).with_name(Path(plot).stem + "_cdf.png")))
        else:
            r = asyncio.run(bench_once(requests, request_rate=args.request_rate,
                                          num_warmups=args.num_warmups, label=args.label,
                                          **kwargs))
            r.update(dataset)
            print(format_summary(r), flush=True)
            write_json(args.result_file, r)
            if plot:
                from pdserve.bench.plots import plot_cdfs

                plot_cdfs({args.label or "pdserve": r}, plot)
        if args.timeline:
            first = runs[0] if args.sweep_rates else r
            _write_timeline(args.address, first["start_unix_s"], args.timeline,
                            kwargs["client_options"])
            _write_pool_timeline(runs if args.sweep_rates else [r], args.timeline)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.result_file}" + (f" and {plot}" if plot else ""), flush=True)
    return 0


# ---- `pdserve bench ...` -------------------------------------------------------------

def add_bench_args(p: argparse.ArgumentParser) -> None:
    from pdserve.bench import choices, compare_modes, kv_transfer, peers, perplexity

    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    sub.required = True
    s = sub.add_parser("serve", help="load a running router (vllm bench serve's metrics)",
                       description=__doc__.splitlines()[0])
    add_serve_args(s)
    s.set_defaults(_bench=run_serve)
    c = sub.add_parser("compare-modes", help="same mixed workload: disaggregated vs normal",
                       description=compare_modes.__doc__.splitlines()[0])
    compare_modes.add_args(c)
    c.set_defaults(_bench=compare_modes.run)
    k = sub.add_parser("kv-transfer", help="KV hand-off bandwidth per transport vs memcpy",
                       description=kv_transfer.__doc__.splitlines()[0])
    kv_transfer.add_args(k)
    k.set_defaults(_bench=kv_transfer.run)
    n = sub.add_parser("choices", help="n choices of a prompt: forks vs n separate requests",
                       description=choices.__doc__.splitlines()[0])
    choices.add_args(n)
    n.set_defaults(_bench=choices.run)
    x = sub.add_parser("perplexity", help="perplexity on a fixed text, beside transformers "
                       "and llama.cpp", description=perplexity.__doc__.splitlines()[0])
    perplexity.add_args(x)
    x.set_defaults(_bench=perplexity.run)
    q = sub.add_parser("peers", help="pdserve beside llama.cpp and vLLM on the same model, "
                       "one run", description=peers.__doc__.splitlines()[0])
    peers.add_args(q)
    q.set_defaults(_bench=peers.run)


def run_bench(args: argparse.Namespace) -> int:
    return int(args._bench(args) or 0)


def register_commands(register) -> None:
    register("bench", "benchmarks: serve (load a router), compare-modes, kv-transfer, choices, "
             "perplexity, peers",
             add_bench_args, run_bench)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_serve_args(p)
    return run_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
