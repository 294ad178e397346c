"""Kernel benchmark: pdserve's runner beside transformers' own forward, same shapes,
same process, same threads.

- prefill: whole prompts of ``L`` tokens for ``B`` requests in one step; tokens/s.
  Ratio = pdserve tokens/s / HF tokens/s (HF: one forward of [B, L] with a fresh
  cache and ``logits_to_keep=1``, i.e. what ``generate`` does).
- decode: one step of ``B`` rows at context ``C`` (q = 1 each); step time.
  Ratio = pdserve step time / HF step time (HF: one forward of [B, 1] over a
  ``DynamicCache`` of length ``C``). KV contents are random: only the cost matters.

Timings on shared machines are noisy; ratios are measured in the same run,
interleaved, taking the median of repeats.

    python -m pdserve.bench.kernels                 # quick (< 2 min on 2 cores)
    python -m pdserve.bench.kernels --full --out results/bench_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.model.tiny import make_tiny_model
from pdserve.engine.model_runner import ModelRunner, RunnerRow, resolve_device, resolve_dtype


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device):
    """Wrap ``fn`` so that calling it returns its wall time in seconds."""
    def run() -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0
    return run


def _paired(ours, theirs, repeats: int) -> tuple[float, float]:
    """Median times of two timed callables, run alternately so that load changes on a
    shared machine hit both alike."""
    ours(), theirs()  # warm-up
    a, b = [], []
    for _ in range(repeats):
        a.append(ours())
        b.append(theirs())
    return statistics.median(a), statistics.median(b)


def bench_prefill(runner, hf, batch: int, length: int, repeats: int) -> dict:
    dev, bs = runner.device, runner.block_size
    g = torch.Generator().manual_seed(batch * 1000 + length)
    ids = torch.randint(3, runner.vocab_size, (batch, length), generator=g)
    nb = math.ceil(length / bs)
    rows = [RunnerRow(ids[b].tolist(), 0, list(range(1 + b * nb, 1 + (b + 1) * nb)), b)
            for b in range(batch)]
    ids_dev = ids.to(dev)

    def ours():
        runner.execute(rows)

    @torch.inference_mode()
    def theirs():
        hf(input_ids=ids_dev, use_cache=True, logits_to_keep=1)

    t_ours, t_hf = _paired(_timed(ours, dev), _timed(theirs, dev), repeats)
    n = batch * length
    return {"batch": batch, "prompt_len": length, "pdserve_tokens_per_s": n / t_ours,
            "hf_tokens_per_s": n / t_hf, "ratio": t_hf / t_ours}


DECODE_STEPS_MAX = 64  # positions a decode benchmark may advance past its context


def bench_decode(runner, hf, batch: int, context: int, repeats: int) -> dict:
    # lazy: transformers is heavy; only the comparison runs need it
    from transformers import DynamicCache

    cfg, dev, bs = runner.config, runner.device, runner.block_size
    nb = math.ceil((context + DECODE_STEPS_MAX) / bs)
    tables = [list(range(1 + b * nb, 1 + (b + 1) * nb)) for b in range(batch)]
    step = [0]

    def ours():
        # Steady state: each call decodes the next position, as an engine does, so the
        # runner's per-row K/V stays warm instead of being rebuilt from blocks every call.
        pos = context + step[0]
        step[0] += 1
        runner.execute([RunnerRow([5 + b], pos, tables[b], b) for b in range(batch)])

    g = torch.Generator().manual_seed(context)
    shape = (batch, cfg.num_kv_heads, context, cfg.head_dim)
    kv = [(torch.randn(shape, generator=g).to(dev, runner.dtype) * 0.1,
           torch.randn(shape, generator=g).to(dev, runner.dtype) * 0.1)
          for _ in range(cfg.num_layers)]
    ids = torch.arange(5, 5 + batch, device=dev)[:, None]

    @torch.inference_mode()
    def theirs():
        cache = DynamicCache(config=hf.config)
        for layer, (k, v) in enumerate(kv):
            cache.update(k, v, layer)
        pos = torch.full((batch, 1), context, device=dev)
        t0 = time.perf_counter()
        hf(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
        _sync(dev)
        return time.perf_counter() - t0

    # theirs() times only the forward, not the building of its cache.
    t_ours, t_hf = _paired(_timed(ours, dev), theirs, repeats)
    return {"batch": batch, "context": context, "pdserve_step_ms": 1e3 * t_ours,
            "hf_step_ms": 1e3 * t_hf, "ratio": t_ours / t_hf}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="HF model folder (default: the built-in tiny llama)")
    ap.add_argument("--size", choices=["tiny", "small"], default="tiny",
                    help="built-in model size when --model-dir is not given")
    ap.add_argument("--variant", choices=["llama", "mistral-swa"], default="llama",
                    help="built-in model variant when --model-dir is not given")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--full", action="store_true", help="more shapes (slower)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default="results/bench_kernels.json")
    return ap


def _shapes(full: bool, repeats: int | None) -> tuple[list, list, int]:
    """(prefill (batch, prompt length) shapes, decode (batch, context) shapes, repeats)."""
    if full:
        prefill_shapes = [(1, 128), (1, 512), (4, 128), (4, 512), (16, 256)]
        decode_shapes = [(1, 128), (8, 128), (32, 128), (1, 512), (8, 512), (32, 512),
                         (64, 512), (32, 1024)]
        return prefill_shapes, decode_shapes, repeats or 7
    prefill_shapes = [(1, 128), (4, 256), (1, 512)]
    decode_shapes = [(1, 512), (8, 512), (32, 128), (32, 512)]
    return prefill_shapes, decode_shapes, repeats or 5


def _summary(prefill: list[dict], decode: list[dict]) -> dict:
    head_d = next((d for d in decode if (d["batch"], d["context"]) == (32, 512)), decode[-1])
    total_ours = sum(p["batch"] * p["prompt_len"] / p["pdserve_tokens_per_s"] for p in prefill)
    total_hf = sum(p["batch"] * p["prompt_len"] / p["hf_tokens_per_s"] for p in prefill)
    ntok = sum(p["batch"] * p["prompt_len"] for p in prefill)
    return {
        "decode_32x512_pdserve_ms": head_d["pdserve_step_ms"],
        "decode_32x512_hf_ms": head_d["hf_step_ms"],
        "decode_32x512_time_ratio_vs_hf": head_d["ratio"],
        "prefill_pdserve_tokens_per_s": ntok / total_ours,
        "prefill_hf_tokens_per_s": ntok / total_hf,
        "prefill_throughput_ratio_vs_hf": total_hf / total_ours,
    }


def _print_results(result: dict, out: Path) -> None:
    for p in result["prefill"]:
        print(f"prefill B={p['batch']:3d} L={p['prompt_len']:5d}: "
              f"{p['pdserve_tokens_per_s']:9.0f} tok/s vs HF {p['hf_tokens_per_s']:9.0f} "
              f"(x{p['ratio']:.2f})")
    for d in result["decode"]:
        print(f"decode  B={d['batch']:3d} C={d['context']:5d}: {d['pdserve_step_ms']:8.2f} ms "
              f"vs HF {d['hf_step_ms']:8.2f} ms (time ratio {d['ratio']:.2f})")
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    # lazy: transformers is heavy; only the comparison runs need it
    from transformers import AutoModelForCausalLM

    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        model_dir = str(make_tiny_model(Path(tmp.name) / "m", args.variant, args.size))
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)

    prefill_shapes, decode_shapes, repeats = _shapes(args.full, args.repeats)
    if repeats + 1 > DECODE_STEPS_MAX:
        ap.error(f"--repeats must be < {DECODE_STEPS_MAX}")
    need_blocks = max(
        max(b * math.ceil(n / 16) for b, n in prefill_shapes),
        max(b * math.ceil((c + DECODE_STEPS_MAX) / 16) for b, c in decode_shapes),
    ) + 2
    max_rows = max(b for b, _ in prefill_shapes + decode_shapes)
    runner = ModelRunner(model_dir, dtype=dtype, device=device, block_size=16,
                         num_kv_blocks=need_blocks, num_state_slots=max_rows)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    t0 = time.time()
    prefill = [bench_prefill(runner, hf, b, n, repeats) for b, n in prefill_shapes]
    decode = [bench_decode(runner, hf, b, c, repeats) for b, c in decode_shapes]
    result = {
        "model_dir": None if tmp else model_dir,
        "model": f"built-in {args.variant}/{args.size}" if tmp else Path(model_dir).name,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "mode": "full" if args.full else "quick",
        "repeats": repeats,
        "prefill": prefill,
        "decode": decode,
        "summary": _summary(prefill, decode),
        "seconds": time.time() - t0,
        "notes": "decode ratio = pdserve/HF step time (lower is better); prefill ratio = "
                 "pdserve/HF tokens per second (higher is better)",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _print_results(result, out)
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
