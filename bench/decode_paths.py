"""Which decode path is fastest, measured: the C decode step built for each vector ISA
this CPU runs, torch.compile'd blocks, and eager torch, side by side in one run.

    python bench/decode_paths.py                          # tiny and small, batch 1 16 64
    python bench/decode_paths.py --sizes small --batch 16 --rounds 5
    python bench/decode_paths.py --paths c-avx2 inductor  # a subset
    python bench/decode_paths.py --sizes real --batch 1 16 --paths c-avx512 c-avx512-fp32

Paths (``--paths``; default all this CPU runs):
  c-avx512, c-avx2, c-generic  the C decode step (``kernels/decode_step``) of that build,
              reading a GGUF model's quantized blocks in place (``quantization="auto"``),
              multiplied by int8 activations (``activation_precision="auto"``)
  c-avx512-exact, ...  the same blocks multiplied by fp32 activations
              (``activation_precision="fp32"``)
  c-avx512-int8, ...  the same blocks multiplied by int8 activations everywhere
              (``activation_precision="int8"``)
  c-avx512-kv32, ...  the default blocks and activations over an fp32 KV cache
              (``kv_precision="fp32"``; the default holds fp16 where activations are int8)
  c-avx512-fp32, ...  the same reading fp32 weights (``quantization="none"``)
  c-avx512-bf16, ...  the same with every matmul the file holds no blocks for in bf16
              (``quantization="bf16"``: a folder model's at half of fp32's bytes)
  compile     ``compile=True, decode_kernel=False``: dense blocks through torch.compile,
              their matmuls skinny_gemm's (host build) where it has panels
  inductor    the same with every matmul left to inductor (``W.T``, MKL): torch.compile
              on its own
  eager       ``decode_kernel=False``: torch, op by op (matmuls on skinny_gemm's panels,
              the host's build, where it has them)
  eager-mkl   the same with every matmul on MKL (``W.T``): torch alone

Per (model, batch): an engine per path, each warmed (first compiles and thread-tuner
trials excluded); then ``--rounds`` rounds, each running every path once in a rotated
order (a noisy neighbour hits all alike) with ``--max-tokens`` decode steps of
``batch`` prompts of ``--prompt-len`` tokens. Reported: the median decode step per
path, its ratio to the fastest path and to the time it takes to read the step's
weights once at the read bandwidth measured in the same run (after each round: the
median of the rounds' ratios, each over its own round's bandwidth, since a shared
machine's drifts by half within minutes), the same for the C paths' call alone
(``DecodeStep.last_call_s``: the step less the Python and torch around it), and the
fastest path (the choice, recorded). Writes JSON (default results/bench_decode_paths.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve import SamplingParams
from pdserve.bench.peer_vllm import cpu_description
from pdserve.bench.serve_report import write_json
from pdserve.engine.config import EngineConfig
from pdserve.engine.model.catalog import resolve_model
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.tiny import make_tiny_model
from pdserve.kernels import cbuild


def _paths_here() -> list[str]:
    # lazy: kernels.decode_step imports torch
    from pdserve.kernels import decode_step

    built = [f"c-{isa}" for isa in cbuild.runnable_isas() if decode_step.available(isa)]
    return [*built, *(f"{c}-{q}" for q in ("exact", "int8", "kv32", "fp32", "bf16")
                      for c in built),
            "compile", "inductor", "eager", "eager-mkl"]


def _engine(model_dir: str, path: str, batch: int, kv_cache_mb: int = 256):
    # lazy: torch and the engine, only when a case runs (not for --help)
    import torch

    from pdserve.engine.engine import LLMEngine

    # Two compiled engines in one process (compile, inductor), each at 1 and 2 threads
    # (ThreadTuner) and a few row counts, share dynamo's per-function recompile budget.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024

    kw: dict = dict(model_dir=model_dir, max_num_seqs=max(batch, 1),
                    max_num_batched_tokens=8192, kv_cache_memory_mb=kv_cache_mb,
                    stop_preempted_request=False, enable_prefix_caching=False)
    if path.startswith("c-"):
        isa, _, held = path[2:].partition("-")
        kw["kernel_isa"] = isa
        kw["quantization"] = {"fp32": "none", "bf16": "bf16", "": "auto", "exact": "auto",
                              "int8": "auto", "kv32": "auto"}[held]
        kw["activation_precision"] = {"exact": "fp32", "int8": "int8"}.get(held, "auto")
        kw["kv_precision"] = "fp32" if held == "kv32" else "auto"
    else:
        kw["decode_kernel"] = False
        kw["compile"] = path in ("compile", "inductor")
    engine = LLMEngine(EngineConfig(**kw))
    model = engine.runner.model
    if path.startswith("c-"):
        assert engine.runner.decode_kernel and model._kernel.step.isa == kw["kernel_isa"]
    if path in ("inductor", "eager-mkl"):  # no skinny_gemm panels: torch's own matmuls
        # lazy: engine.model.llama imports torch
        from pdserve.engine.model.llama import MatMul

        for m in model.modules():
            if isinstance(m, MatMul) and m.panels is not None:
                m.panels = None
                m.use_transposed()
    if path == "inductor":
        # lazy: compiled_decode imports torch
        from pdserve.engine.model.compiled_decode import CompiledDecode

        model.use_compiled(CompiledDecode(model))  # rebuilt: it reads the operands it finds
    return engine


def _decode_steps(engine, prompts: list[list[int]], max_tokens: int, tag: str
                  ) -> tuple[list[float], list[float]]:
    """The full-batch decode steps' durations, and those of their C calls (a C path's;
    else empty)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    kernel = getattr(engine.runner.model, "_kernel", None)
    steps, calls = [], []
    while engine.has_work():
        out = engine.step()
        if out.kind == "decode" and out.num_scheduled_tokens == len(prompts):
            steps.append(out.duration_s)  # full-batch decode steps only
            if kernel is not None:
                calls.append(kernel.step.last_call_s)
    if len(steps) < max_tokens - 2:  # a step failed and its requests ended early
        raise RuntimeError(f"{tag}: {len(steps)} full decode steps of {max_tokens}")
    return steps, calls


def run_case(size: str, model_dir: str, batch: int, paths: list[str], args) -> dict:
    # lazy: bench.offline imports torch
    from pdserve.bench.offline import make_prompts, measure_bandwidth, weight_read_bytes

    vocab = ModelConfig.from_model(model_dir).vocab_size
    prompts = make_prompts(vocab, batch, args.prompt_len, seed=batch)
    engines = {}
    for path in paths:
        t = time.perf_counter()
        engines[path] = _engine(model_dir, path, batch, args.kv_cache_mb)
        _decode_steps(engines[path], prompts, min(args.max_tokens, 8), f"warm-{path}")
        _decode_steps(engines[path], prompts, min(args.max_tokens, 8), f"warm2-{path}")
        print(f"  {size} batch {batch}: {path} ready ({time.perf_counter() - t:.1f} s)",
              file=sys.stderr, flush=True)
    medians: dict[str, list[float]] = {p: [] for p in paths}
    call_medians: dict[str, list[float]] = {p: [] for p in paths if p.startswith("c-")}
    measured: list[dict] = []  # each round's bandwidth: a shared machine's drifts
    for r in range(args.rounds):
        order = paths[r % len(paths):] + paths[:r % len(paths)]
        for path in order:
            steps, calls = _decode_steps(engines[path], prompts, args.max_tokens, f"r{r}-{path}")
            medians[path].append(statistics.median(steps))
            if path in call_medians:
                call_medians[path].append(statistics.median(calls))
        measured.append(measure_bandwidth(repeats=3))
    read_gbps = [m["read_GBps"] for m in measured]
    bw = measured[0] | {k: statistics.median(m[k] for m in measured)
                        for k in ("copy_GBps_read_plus_write", "read_GBps")}
    bw["read_GBps_per_round"] = read_gbps
    weight_bytes = {p: weight_read_bytes(e.runner.model) for p, e in engines.items()}
    limit_ms = {p: 1e3 * b / (bw["read_GBps"] * 1e9) for p, b in weight_bytes.items()}
    def over_read(per_round: dict[str, list[float]]) -> dict[str, float]:
        """Each round's time over the weights' read at that round's bandwidth."""
        return {p: statistics.median(s * g * 1e9 / weight_bytes[p]
                                     for s, g in zip(v, read_gbps, strict=True))
                for p, v in per_round.items()}

    over, call_over = over_read(medians), over_read(call_medians)
    step_ms = {p: 1e3 * statistics.median(v) for p, v in medians.items()}
    fastest = min(step_ms, key=step_ms.get)
    del engines
    return {"model": size, "batch": batch, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "rounds": args.rounds,
            "step_ms": {p: round(v, 3) for p, v in step_ms.items()},
            "step_ms_per_round": {p: [round(1e3 * s, 3) for s in v] for p, v in medians.items()},
            "over_fastest": {p: round(v / step_ms[fastest], 2) for p, v in step_ms.items()},
            "weights_once_at_read_bw_ms": {p: round(v, 3) for p, v in limit_ms.items()},
            "over_weight_read": {p: round(v, 2) for p, v in over.items()},
            # the C paths' call alone: what the Python around it adds is the difference
            "kernel_ms": {p: round(1e3 * statistics.median(v), 3) for p, v in call_medians.items()},
            "kernel_over_weight_read": {p: round(v, 2) for p, v in call_over.items()},
            "bandwidth": bw, "fastest": fastest}


def format_rows(rows: list[dict]) -> str:
    paths = list(rows[0]["step_ms"]) if rows else []
    head = f"{'model':>6} {'batch':>5} " + " ".join(f"{p:>10}" for p in paths)
    lines = [head + "  fastest"]
    for r in rows:
        cells = " ".join(f"{r['step_ms'][p]:>8.2f}ms" for p in paths)
        lines.append(f"{r['model']:>6} {r['batch']:>5} {cells}  {r['fastest']}")
        lines.append(f"{'':>12} " + " ".join(f"{r['weights_once_at_read_bw_ms'][p]:>8.2f}ms"
                                              for p in paths) + "   (weights read once at bw)")
        lines.append(f"{'':>12} " + " ".join(f"{r['over_weight_read'][p]:>9.2f}x" for p in paths)
                     + "   (step / weights read once)")
        kernel = r.get("kernel_over_weight_read", {})
        if kernel:
            lines.append(f"{'':>12} " + " ".join(f"{kernel[p]:>9.2f}x" if p in kernel
                                                  else f"{'-':>10}" for p in paths)
                         + "   (its C call / weights read once)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"],
                   choices=["tiny", "small", "real"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--paths", nargs="+", default=None, help="default: every path this CPU runs")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32, help="decode steps per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-mb", type=int, default=256,
                   help="each engine's KV budget (default 256: 16 rows of 512 prompt tokens "
                        "fit an fp16 cache, not an fp32 one)")
    p.add_argument("--result-file", default="results/bench_decode_paths.json")
    args = p.parse_args(argv)
    available = _paths_here()
    paths = args.paths or available
    missing = [x for x in paths if x not in available]
    if missing:
        p.error(f"--paths {missing} cannot run here (this CPU runs {available})")

    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-paths-") as root:
        for size in args.sizes:
            model_dir = (resolve_model("smollm2-135m-instruct").path if size == "real"
                         else str(make_tiny_model(Path(root) / size, size=size)))
            for batch in args.batch:
                rows.append(run_case(size, model_dir, batch, paths, args))
                print(format_rows(rows[-1:]), flush=True)

    out = write_json(args.result_file, {"benchmark": "decode_paths", "cpu": cpu_description(),
                                        "results": rows})
    print(format_rows(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
