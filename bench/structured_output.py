"""What structured output costs: 16 streams, half of them under a JSON schema, against
16 unconstrained streams, side by side in one run; each test schema's compile time; and
whether a request with a new schema raises the others' ITL p99.

    pdserve bench structured-output                     # the real model, 1P+1D
    pdserve bench structured-output --rounds 3 --streams 16 --requests 48

Brings up a router in this process (embedded Ray, loopback only) on the default model
and runs closed loops of ``--streams`` concurrent gRPC streams, alternating, each round:
``plain`` (every stream unconstrained, 128 tokens), ``half`` (half the streams under a
JSON schema the ranks already compiled) and ``fresh`` (as ``half``, but every guided
request brings a schema never seen before, so each is compiled while the others step).
ITL is the time between two streamed messages over the tokens they carry, per request,
as the client sees it; the unconstrained streams' ITL is reported apart. Compile time:
each test schema compiled for the model's tokenizer by a fresh compiler (``--compiles``
times). Writes JSON (``--result-file``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from pdserve.bench.harness import RouterHarness, start_embedded_ray
from pdserve.bench.standalone import standalone_main
from pdserve.engine.guided.grammar import GrammarBook
from pdserve.engine.model.tokenizer import Tokenizer
from pdserve.router.client import AsyncClient
from pdserve.router.config import PoolConfig, RouterConfig
from pdserve.scheduler.sampling_params import Guide

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                              "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "items": {"type": "array", "maxItems": 12, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                             "qty": {"type": "integer", "minimum": 1,
                                                     "maximum": 99},
                                             "tag": {"enum": ["a", "b", "c", "d"]}},
            "required": ["name", "qty", "tag"]}}},
        "required": ["title", "items"]},
    "pattern": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "scores": {"type": "array", "maxItems": 8,
                   "items": {"type": "number", "minimum": 0, "maximum": 100}}},
        "required": ["id", "email", "scores"]},
}
SEED_BASE = {"plain": 0, "half": 100_000, "fresh": 200_000}
PROMPT = [{"role": "user", "content": "Write a long shopping list as JSON, with many items."}]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model (default: smollm2-135m-instruct)")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams")
    p.add_argument("--requests", type=int, default=48, help="requests per phase")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compiles", type=int, default=20, help="compiles of each schema")
    p.add_argument("--result-file", default="results/bench_structured_output.json")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def compile_times(model: str, repeats: int) -> dict:
    """ms to compile each schema for the model's tokenizer, a fresh compiler each time
    (so nothing is cached), as GrammarBook compiles it on a rank."""
    tokenizer = Tokenizer.from_model(model)
    out = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(repeats):
            book = GrammarBook(tokenizer, tokenizer.vocab_size)
            book.request(Guide("json", "{}")).result()  # the tokenizer's info, not timed
            started = time.perf_counter()
            book.request(Guide("json", json.dumps(schema))).result()
            times.append((time.perf_counter() - started) * 1e3)
            book.close()
        out[name] = {"p50_ms": statistics.median(times), "p99_ms": _percentile(times, 0.99)}
    return out


async def _one(client, i: int, guided: bool, fresh: bool, max_tokens: int, itl: dict):
    settings = dict(max_tokens=max_tokens, temperature=0.8, seed=i)
    if guided:
        schema = dict(SCHEMAS["nested"])
        if fresh:  # a schema no rank has seen: an extra property named for the request
            schema = {**schema, "properties": {**schema["properties"],
                                               f"note_{i}": {"type": "string",
                                                             "maxLength": 8}}}
        settings["structured_output"] = {"json_schema": schema}
    else:
        settings["ignore_eos"] = True
    last = None
    gaps = itl["guided" if guided else "plain"]
    async for msg in client.stream(PROMPT, **settings):
        now = time.perf_counter()
        if last is not None and msg.token_ids:
            gaps.extend([(now - last) / len(msg.token_ids)] * len(msg.token_ids))
        if msg.token_ids:
            last = now
        if msg.finish_reason and msg.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"request {i} ended {msg.finish_reason}: {msg.error}")


async def _phase(address: str, phase: str, streams: int, requests: int,
                 max_tokens: int) -> dict:
    """A closed loop: ``streams`` requests at a time until ``requests`` have run."""
    itl: dict[str, list[float]] = {"plain": [], "guided": []}
    todo = iter(range(requests))

    async def worker(slot: int):
        for i in todo:
            guided = phase != "plain" and slot % 2 == 1
            await _one(client, SEED_BASE[phase] + i, guided, phase == "fresh",
                       max_tokens, itl)

    async with AsyncClient(address, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(s) for s in range(streams)))
        wall = time.perf_counter() - started
    every = itl["plain"] + itl["guided"]
    return {"wall_s": wall, "tokens": len(every),
            "itl_p50_ms": statistics.median(every) * 1e3,
            "itl_p99_ms": _percentile(every, 0.99) * 1e3,
            "plain_itl_p50_ms": statistics.median(itl["plain"]) * 1e3,
            "plain_itl_p99_ms": _percentile(itl["plain"], 0.99) * 1e3}


def _router_config(model: str):
    engine = dict(num_kv_blocks=1024, max_num_seqs=32, block_size=16)
    return RouterConfig(
        model_dir=model, port=0, http_port=0,
        prefill=PoolConfig("prefill", replicas=1, num_cpus=0.5, resources={"prefill": 1},
                           engine=engine),
        decode=PoolConfig("decode", replicas=1, num_cpus=0.5, resources={"decode": 1},
                          engine=engine))


def _ratios(runs: dict[str, list[dict]]) -> dict:
    med = {phase: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for phase, rs in runs.items()}
    return {
        "median": med,
        "half_over_plain_itl_p50": med["half"]["itl_p50_ms"] / med["plain"]["itl_p50_ms"],
        "half_over_plain_unconstrained_itl_p50":
            med["half"]["plain_itl_p50_ms"] / med["plain"]["plain_itl_p50_ms"],
        "fresh_over_half_unconstrained_itl_p99":
            med["fresh"]["plain_itl_p99_ms"] / med["half"]["plain_itl_p99_ms"],
    }


def run(args: argparse.Namespace) -> int:
    model = start_embedded_ray(args.model or "smollm2-135m-instruct")
    report: dict = {"args": {k: v for k, v in vars(args).items() if not callable(v)}}
    report["compile"] = compile_times(model, args.compiles)
    for name, t in report["compile"].items():
        print(f"compile {name:8s} p50 {t['p50_ms']:7.2f} ms  p99 {t['p99_ms']:7.2f} ms",
              flush=True)
    harness = RouterHarness(_router_config(model))
    runs: dict[str, list[dict]] = {"plain": [], "half": [], "fresh": []}
    try:
        asyncio.run(_phase(harness.address, "half", args.streams, args.streams,
                           args.max_tokens))  # warm up: the schema compiled, paths hot
        for r in range(args.rounds):
            order = ("plain", "half", "fresh") if r % 2 == 0 else ("fresh", "half", "plain")
            for phase in order:
                stats = asyncio.run(_phase(harness.address, phase, args.streams,
                                           args.requests, args.max_tokens))
                runs[phase].append(stats)
                print(f"[{r + 1}/{args.rounds}] {phase:5s} ITL p50 {stats['itl_p50_ms']:6.1f} "
                      f"p99 {stats['itl_p99_ms']:6.1f} ms; unconstrained p50 "
                      f"{stats['plain_itl_p50_ms']:6.1f} p99 {stats['plain_itl_p99_ms']:6.1f}",
                      flush=True)
    finally:
        harness.close()
    report["runs"] = runs
    report.update(_ratios(runs))
    for key in ("half_over_plain_itl_p50", "half_over_plain_unconstrained_itl_p50",
                "fresh_over_half_unconstrained_itl_p99"):
        print(f"{key}: {report[key]:.3f}")
    path = Path(args.result_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


main = standalone_main(__doc__, add_args, run)

if __name__ == "__main__":
    raise SystemExit(main())
