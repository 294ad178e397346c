"""Decode matmuls by weight layout: skinny_gemm panels against torch's layouts.

Every decode matmul of a model (each layer's q|k|v, o, gate|up, down, and the LM head)
at a few row counts, through each layout ``MatMul`` can hold: ``skinny_gemm`` panels,
oneDNN-packed weights, a contiguous ``W.T`` for ``torch.mm``, and ``F.linear`` on the
plain weight (what transformers runs). The weights are read cold (the model's are much
larger than the caches), the layouts alternate within each round, and each reports its
best and median round, the GB/s of weights that makes, and its time over the best
torch layout's in the same round. The machine's read bandwidth is measured alongside.
Writes JSON (default results/bench_decode_matmul.json).

    python bench/decode_matmul.py                       # small model, 16/64/128 rows
    python bench/decode_matmul.py --size tiny --rows 16 --threads 1
    python bench/decode_matmul.py --model-dir DIR       # any Hugging Face folder
    python bench/decode_matmul.py --model-dir smollm2-135m-instruct --rows 16 512 2048

A quantized GGUF file (``--model-dir``: a file, folder or built-in name) adds its
quantized panels (``quant_panels``), which ``MatMul`` multiplies for every product, the
prompts' included: the rows past 128 show them against torch's fp32 GEMMs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.bench.offline import measure_bandwidth
from pdserve.engine.model.catalog import resolve_model
from pdserve.engine.model.llama import MatMul, load_model
from pdserve.engine.model.tiny import make_tiny_model
from pdserve.kernels import quant_panels, skinny_gemm


def _layouts(weights: list[torch.Tensor], quant: list | None = None) -> dict:
    """name -> function(x by in_features) running every matmul once; ``quant``: each
    one's quantized panels, where every matmul has them (a quantized GGUF file)."""
    def over(prepared, call):
        return lambda xs: [call(xs[w.shape[1]], w, p) for w, p in zip(weights, prepared,
                                                                          strict=True)]

    out = {"linear": over(weights, lambda x, w, p: F.linear(x, w)),
           "transposed": over([w.t().contiguous() for w in weights],
                              lambda x, w, p: torch.mm(x, p))}
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
        out["onednn_packed"] = over(packed, lambda x, w, p: torch.ops.mkldnn._linear_pointwise(
            x, p, None, "none", [], ""))
    if skinny_gemm.available():
        out["skinny_gemm"] = over([skinny_gemm.pack(w) for w in weights],
                                  lambda x, w, p: skinny_gemm.matmul(x, p, w.shape[0]))
    if quant and skinny_gemm.available():
        out[QUANT] = over(quant, lambda x, w, p: quant_panels.matmul(x, p))
    return out


OURS = ("skinny_gemm", "quant_panels")  # the others are torch's layouts
QUANT = OURS[1]


def decode_weights(model) -> tuple[list[torch.Tensor], list | None]:
    """Every matmul's fp32 weight (load with ``keep_fp32``), and its quantized panels
    where every matmul has them, else None."""
    mats = [m for m in model.modules() if isinstance(m, MatMul)]
    quant = [m.quant for m in mats]
    return [m.weight.detach() for m in mats], quant if all(q is not None for q in quant) else None


def run(weights: list[torch.Tensor], rows: int, rounds: int, quant: list | None = None) -> dict:
    layouts = _layouts(weights, quant)
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for f in layouts.values():
        f(xs)  # first-call costs
    for r in range(rounds):
        order = list(layouts) if r % 2 == 0 else list(layouts)[::-1]
        for name in order:
            start = time.perf_counter()
            layouts[name](xs)
            times[name].append(time.perf_counter() - start)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    torch_best = [min(times[n][i] for n in times if n not in OURS) for i in range(rounds)]
    result = {}
    for name, ts in times.items():
        result[name] = {
            "best_ms": round(1000 * min(ts), 2), "median_ms": round(1000 * statistics.median(ts), 2),
            "weights_GBps_best": round(nbytes / min(ts) / 1e9, 1),
            "over_best_torch_layout_median": round(statistics.median(
                [t / b for t, b in zip(ts, torch_best, strict=True)]), 3),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="a Hugging Face folder (default: a built-in model)")
    ap.add_argument("--size", choices=["tiny", "small"], default="small")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default="results/bench_decode_matmul.json")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is not None:
        model_dir = resolve_model(model_dir).path
    else:
        model_dir = str(Path(tempfile.mkdtemp(prefix="pdserve-bench-")) / args.size)
        make_tiny_model(model_dir, variant="llama", size=args.size)
    _, model = load_model(model_dir, keep_fp32=True)  # torch's layouts need the fp32 weights
    weights, quant = decode_weights(model)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    result = {"benchmark": "decode_matmul", "model_dir": model_dir, "threads": torch.get_num_threads(),
              "weight_bytes": nbytes, "bandwidth": measure_bandwidth(), "rows": {}}
    print(f"{len(weights)} matmuls, {nbytes / 1e6:.1f} MB of weights, "
          f"{result['threads']} threads; read bandwidth {result['bandwidth']['read_GBps']} GB/s")
    for rows in args.rows:
        r = result["rows"][str(rows)] = run(weights, rows, args.rounds, quant)
        cells = "  ".join(f"{n} {v['best_ms']} ms ({v['weights_GBps_best']} GB/s, "
                          f"x{v['over_best_torch_layout_median']})" for n, v in r.items())
        print(f"rows {rows:4d}: {cells}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
