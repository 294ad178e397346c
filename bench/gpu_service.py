"""The disaggregated service end to end on one machine's device (`scripts/gpu_check.py
--service`): a random-weight model of a named shape (bf16; `llama-1b` on a GPU) served
1 prefill + 1 decode rank by `pdserve serve` through Ray and the router (on one GPU the
two ranks share it, half each), checked and measured as a user meets it:

1. the offline normal engine's greedy tokens for a few prompts, computed first (its
   memory freed before the service starts);
2. the same prompts through the router: tokens equal, and each request's hand-off
   (`kv_handoff_span_ms`: first token sampled on the prefill rank -> the decode rank's
   import done);
3. `pdserve bench serve`'s client at each concurrency: TTFT and ITL medians, output
   tokens/s;
4. the hand-offs by the path they took (`kv_paths`, from the router's metrics: on one
   GPU `cuda_ipc`, unless the driver refused it and a pair group carried them).

Runs on the CPU too (``device="cpu"``, the `cpu-smoke` shape), which is how the suite
tests it; a GPU only changes the shape and the device.
"""

from __future__ import annotations

import asyncio
import gc
import random
import re
import socket
import statistics
import tempfile
import urllib.request
from pathlib import Path

from pdserve.bench.datasets import SampleRequest
from pdserve.bench.routers import subprocess_router
from pdserve.bench.serve_report import run_benchmark
from pdserve.router.client import Client


def _prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _offline_greedy(folder: str, device: str, prompts: list[list[int]], out: int) -> list[list[int]]:
    # lazy: torch and the offline engine, only for the equality check
    import torch

    from pdserve import LLM, SamplingParams

    llm = LLM(folder, device=device, max_num_seqs=len(prompts))
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                use_tqdm=False)]
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return tokens


def _served_greedy(address: str, prompts: list[list[int]], out: int) -> list[dict]:
    """Each prompt through the router, one at a time: its tokens and hand-off span."""
    rows = []
    with Client(address, timeout=600) as client:
        for prompt in prompts:
            tokens, last = [], None
            for msg in client.stream(prompt, max_tokens=out, temperature=0, ignore_eos=True):
                tokens += list(msg.token_ids)
                last = msg
            timings = last.timings if last is not None and last.HasField("timings") else None
            rows.append({"tokens": tokens,
                         "handoff_ms": timings.kv_handoff_span_ms if timings else 0.0,
                         "kv_bytes": timings.kv_bytes if timings else 0})
    return rows


def _load(address: str, streams: int, per_stream: int, prompt_len: int, out: int,
          vocab: int) -> dict:
    requests = [SampleRequest(p, prompt_len, out)
                for p in _prompts(streams * per_stream, prompt_len, vocab, seed=streams)]
    result = asyncio.run(run_benchmark(address, requests, max_concurrency=streams,
                                       ignore_eos=True, progress=False, num_warmups=1))
    return {"streams": streams, "requests": result["num_prompts"],
            "ttft_ms_median": round(result["median_ttft_ms"], 2),
            "itl_ms_median": round(result["median_itl_ms"], 2),
            "output_tok_s": round(result["output_throughput"], 1)}


def service_check(device: str = "cuda", shape: str = "llama-1b", streams=(1, 16, 64),
                  per_stream: int = 4, prompt_len: int = 128, out: int = 32,
                  greedy_prompts: int = 4, start_timeout: float = 600.0) -> dict:
    """The summary (see the module docstring): greedy_equal_offline, per-concurrency
    TTFT and ITL, handoff_ms (median over the greedy requests)."""
    # lazy: torch and bench.gpu (which imports torch), only when the check runs
    import torch

    from pdserve.bench.gpu import SHAPES, make_model

    vocab = SHAPES[shape]["vocab_size"]
    gpu = device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="pdserve-service-") as tmp:
        folder = Path(tmp) / shape
        make_model(folder, shape, torch.device(device))
        prompts = _prompts(greedy_prompts, prompt_len, vocab)
        offline = _offline_greedy(str(folder), device, prompts, out)
        placement = ("--device", "cuda", "--num-gpus", "0.5") if gpu else ("--device", "cpu")
        metrics = _free_port()
        with subprocess_router({"mode": "disaggregated", "prefill": 1, "decode": 1},
                               model=str(folder), kv_transport="auto",
                               max_num_seqs=max(streams), start_timeout=start_timeout,
                               extra_args=(*placement, "--metrics-port", str(metrics))) as address:
            served = _served_greedy(address, prompts, out)
            loads = [_load(address, s, per_stream, prompt_len, out, vocab) for s in streams]
            paths = kv_paths(metrics)
    equal = [row["tokens"] == want for row, want in zip(served, offline, strict=True)]
    spans = [row["handoff_ms"] for row in served if row["handoff_ms"] > 0]
    return {"device": device, "shape": shape, "prompt_len": prompt_len, "output_len": out,
            "greedy_equal_offline": all(equal), "greedy_equal": equal,
            "handoff_ms": round(statistics.median(spans), 3) if spans else None,
            "kv_bytes": served[0]["kv_bytes"] if served else 0,
            "kv_paths": paths, "load": loads}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kv_paths(port: int) -> dict[str, int]:
    """The router's hand-offs by the path they took (``pdserve_kv_deliveries_total``):
    on one GPU, ``cuda_ipc`` unless the driver refused it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {m.group(1): int(float(m.group(2))) for m in re.finditer(
        r'^pdserve_kv_deliveries_total\{path="([^"]+)"\} (\S+)$', text, re.MULTILINE)}
