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

This module is the command line (the workload from its arguments, the runs it asks
for); the client that sends and records is `serve_client.py`, the result dict, its
summary table and the files written are `serve_report.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from pdserve.bench import prefix_compare
from pdserve.bench.datasets import chat_requests, mixed_requests, prefix_requests, random_requests
from pdserve.bench.load_timeline import RateSchedule, checked_interval
from pdserve.bench.openai_backend import OpenAIBackend
from pdserve.bench.plots import plot_cdfs, plot_sweep
from pdserve.bench.serve_metrics import parse_goodput
from pdserve.bench.serve_report import (  # run_benchmark: the library entry point
    format_summary,
    run_benchmark,
    write_json,
    write_pool_timeline,
    write_timeline,
)
from pdserve.engine.model.catalog import ModelError, resolve_model
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.tokenizer import Tokenizer
from pdserve.router.chat_template import ChatTemplate
from pdserve.router.client_args import add_client_args, client_options

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_RESULT = "results/bench_serve.json"


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
        try:
            model = resolve_model(model).path
        except ModelError as exc:
            raise SystemExit(f"error: {exc} (pass --model PATH, or --vocab-size N with "
                             "--prompt-format ids)") from None
        if vocab is None:
            vocab = ModelConfig.from_model(model).vocab_size
        if args.prompt_format == "text":
            tokenizer = Tokenizer.from_model(model)
    return vocab, tokenizer


def build_requests(args: argparse.Namespace) -> list:
    if args.num_prompts < 1:
        raise SystemExit("error: --num-prompts must be >= 1")
    vocab, tokenizer = model_info(args)
    common = dict(vocab_size=vocab, range_ratio=args.random_range_ratio, seed=args.seed,
                  prompt_format=args.prompt_format, tokenizer=tokenizer)
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               **common)
    if args.dataset_name == "chat":
        template = ChatTemplate.from_model_dir(resolve_model(args.model).path)
        if tokenizer is None:
            tokenizer = Tokenizer.from_model(resolve_model(args.model).path)
        return chat_requests(args.num_prompts, args.random_output_len, chat_template=template,
                             tokenizer=tokenizer, seed=args.seed,
                             prompt_format=args.prompt_format)
    if args.dataset_name == "prefix":
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
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return dict(burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                seed=args.seed, slos=slos, percentiles=parse_floats(args.metric_percentiles),
                temperature=args.temperature, ignore_eos=not args.no_ignore_eos,
                request_timeout=args.request_timeout, progress=not args.disable_tqdm)


def _rate_schedule(args: argparse.Namespace):
    """The parsed --rate-schedule (None without one); sets --num-prompts to its count."""
    if not args.rate_schedule:
        return None, None

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


def _options_error(args: argparse.Namespace, kwargs: dict, sampled: bool) -> str | None:
    """Adds the pools' sampling interval (when `sampled`) and the client's options to
    `kwargs`; what is wrong with the arguments, if anything."""
    if sampled:
        try:
            kwargs["sample_interval_s"] = checked_interval(args.sample_interval)
        except ValueError as exc:
            return str(exc)
    try:
        kwargs["client_options"] = client_options(args)
    except (ValueError, OSError) as exc:
        return str(exc)
    if args.backend == "openai":
        if not args.base_url:
            return "--backend openai needs --base-url"
        if args.timeline:
            return "--timeline needs the pdserve backend (the router's GetTimeline)"
    return None


async def _bench_once(args: argparse.Namespace, requests: list, **kw) -> dict:
    """One run, with a client of its own (the router's, or an OpenAI server's)."""
    if args.backend != "openai":
        return await run_benchmark(args.address, requests, **kw)

    backend = OpenAIBackend(args.base_url, args.served_model_name,
                            kw.pop("client_options")["token"])
    try:
        return await run_benchmark(args.base_url, requests, client=backend, **kw)
    finally:
        await backend.close()


def _run_sweep(args: argparse.Namespace, requests: list, kwargs: dict, dataset: dict,
               plot: str | None) -> list[dict]:
    """One run per --sweep-rates rate (the first warmed up); written and drawn."""
    runs = []
    for i, rate in enumerate(parse_floats(args.sweep_rates)):
        r = asyncio.run(_bench_once(args, requests, request_rate=rate,
                                    num_warmups=args.num_warmups if i == 0 else 0,
                                    label=f"rate {rate:g}", **kwargs))
        r.update(dataset)
        print(format_summary(r), flush=True)
        runs.append(r)
    out = {"sweep_rates": [r["request_rate"] for r in runs], "runs": runs, **dataset}
    write_json(args.result_file, out)
    if plot:
        plot_sweep(runs, plot)
        plot_cdfs({f"rate {r['request_rate']}": r for r in runs},
                  str(Path(plot).with_name(Path(plot).stem + "_cdf.png")))
    return runs


def _run_once(args: argparse.Namespace, requests: list, kwargs: dict, dataset: dict,
              plot: str | None) -> dict:
    """One run at --request-rate; written and drawn."""
    r = asyncio.run(_bench_once(args, requests, request_rate=args.request_rate,
                                num_warmups=args.num_warmups, label=args.label, **kwargs))
    r.update(dataset)
    print(format_summary(r), flush=True)
    write_json(args.result_file, r)
    if plot:
        plot_cdfs({args.label or "pdserve": r}, plot)
    return r


def run_serve(args: argparse.Namespace) -> int:
    schedule, offsets = _rate_schedule(args)
    requests = build_requests(args)
    kwargs = load_kwargs(args)
    if schedule is not None:
        kwargs.update(offsets=offsets, hold_s=schedule.total_s, rate_schedule=schedule)
    error = _options_error(args, kwargs, sampled=schedule is not None or bool(args.timeline))
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.compare_caching:
        prefix_compare.run(args, requests, kwargs)
        return 0
    dataset = {"dataset_name": args.dataset_name, "prompt_format": args.prompt_format}
    plot = None if args.no_plot else (args.plot or str(Path(args.result_file).with_suffix(".png")))
    try:
        if args.sweep_rates:
            results = _run_sweep(args, requests, kwargs, dataset, plot)
        else:
            results = [_run_once(args, requests, kwargs, dataset, plot)]
        if args.timeline:
            write_timeline(args.address, results[0]["start_unix_s"], args.timeline,
                           kwargs["client_options"])
            write_pool_timeline(results, args.timeline)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.result_file}" + (f" and {plot}" if plot else ""), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_serve_args(p)
    return run_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
