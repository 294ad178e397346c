"""Offline throughput: pdserve's NORMAL engine against Hugging Face `generate`.

Same checkpoint, same prompts, greedy, fp32, same process and thread count. The
machine may be shared (load changes during a run), so both sides run alternately
(HF first on even repeats, pdserve first on odd ones) and the ratio is reported per
pair and as the median over pairs. pdserve picks 1 thread or the given count per step
(whichever it has timed faster); HF runs at the given count, and, as a control, also
at ``--hf-alt-threads`` (default 1), so the ratio against HF's better setting is in
the output too. Writes JSON (default results/bench_offline.json).

    python bench/offline.py                      # tiny and small built-in models, batch 16
    python bench/offline.py --quick              # tiny only, 2 pairs (a smoke run)
    python bench/offline.py --batch 16 64 --repeats 5
    python bench/offline.py --model DIR --prompts ids.json --batch 16 64
    python bench/offline.py --sizes small --analyse   # + step profile and bandwidth limit

``--analyse`` (on by default for the small model) profiles one prefill step and the
decode steps of a pdserve run (time per op category), measures the machine's memory
bandwidth with a large tensor copy, and compares a decode step with the time it takes
just to read the weights once at that bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve import LLM, SamplingParams
from pdserve.engine.model.tiny import make_tiny_model

# Wall time by default; ``--clock cpu`` (with ``--threads 1``) times CPU seconds of this
# process instead, which other users' load inflates far less: a measure of work done.
CLOCK = time.perf_counter


def make_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids, where the special tokens live.
    return [[rng.randrange(8, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


class HFSide:
    """transformers' own best CPU setup: fp32, SDPA attention, its own KV cache, the
    same thread count (torch's global setting), inference mode."""

    def __init__(self, model_dir: str):
        # lazy: transformers is heavy; only the HF side needs it
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
        # EOS neither stops nor is banned: the equivalent of pdserve's ``ignore_eos``.
        # (``min_new_tokens`` would set EOS's logit to -inf, so the two would differ
        # wherever EOS is the argmax; a None passed to generate() is replaced by the
        # model's own generation config, hence it is cleared there.)
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0

    def run(self, prompts: list[list[int]], max_tokens: int,
            threads: int | None = None) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts)  # equal lengths: no padding needed
        caller = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            return self._run(ids, max_tokens)
        finally:
            torch.set_num_threads(caller)

    def _run(self, ids: torch.Tensor, max_tokens: int) -> tuple[float, list[list[int]]]:
        with torch.inference_mode():
            start = CLOCK()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=max_tokens, do_sample=False)
            elapsed = CLOCK() - start
        return elapsed, out[:, ids.shape[1]:].tolist()


class PdserveSide:
    def __init__(self, model_dir: str, batch: int, compile: bool = False,
                 kernel_isa: str = "auto"):
        self.llm = LLM(model_dir, max_num_seqs=max(batch, 1), max_num_batched_tokens=4096,
                       compile=compile, kernel_isa=kernel_isa)

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = CLOCK()
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        elapsed = CLOCK() - start
        return elapsed, [o.token_ids for o in outs]


def run_case(name: str, model_dir: str, prompts: list[list[int]], max_tokens: int,
             repeats: int, hf_alt_threads: int = 0, compile: bool = False) -> dict:
    """``hf_alt_threads``: also time HF at this thread count (a control: pdserve picks
    its thread count per step, HF cannot, and on a loaded machine HF may do better
    with fewer threads than the benchmark's setting). ``compile``: also time pdserve
    with ``LLM(compile=True)`` (its compile warm-up is reported, not timed)."""
    hf, pd = HFSide(model_dir), PdserveSide(model_dir, len(prompts))
    warm = [p[:16] for p in prompts[:2]]
    hf.run(warm, 2), pd.run(warm, 2)  # first-call costs (allocations, kernel choice)
    compile_s = None
    if compile:
        pdc = PdserveSide(model_dir, len(prompts), compile=True)
        start = time.perf_counter()
        # The whole workload once: graphs for each key length, row count and thread
        # count the tuner picks (torch.compile guards on the thread count).
        pdc.run(warm, 3), pdc.run(prompts, max_tokens)
        compile_s = time.perf_counter() - start
    times: dict[str, list[float]] = {"hf": [], "pd": [], "hf_alt": [], "pdc": []}
    runs = {"hf": lambda: hf.run(prompts, max_tokens), "pd": lambda: pd.run(prompts, max_tokens),
            "hf_alt": lambda: hf.run(prompts, max_tokens, threads=hf_alt_threads)}
    if compile:
        runs["pdc"] = lambda: pdc.run(prompts, max_tokens)
    order = ["hf", "pd"] + (["hf_alt"] if hf_alt_threads else []) + (["pdc"] if compile else [])
    load_before = os.getloadavg()[0]
    tokens = {}
    for r in range(repeats):
        for tag in (order if r % 2 == 0 else order[::-1]):
            s, tokens[tag] = runs[tag]()
            times[tag].append(s)
    hf_times, pd_times = times["hf"], times["pd"]
    hf_tokens, pd_tokens = tokens["hf"], tokens["pd"]
    total = len(prompts) * max_tokens
    same = sum(a == b for a, b in zip(hf_tokens, pd_tokens, strict=True))
    pair_ratios = [h / p for h, p in zip(hf_times, pd_times, strict=True)]
    hf_s, pd_s = statistics.median(hf_times), statistics.median(pd_times)
    row = {
        "model": name, "batch": len(prompts), "prompt_len": len(prompts[0]),
        "output_len": max_tokens, "repeats": repeats,
        "hf_seconds": [round(t, 3) for t in hf_times],
        "pdserve_seconds": [round(t, 3) for t in pd_times],
        "hf_output_tok_per_s": round(total / hf_s, 1),
        "pdserve_output_tok_per_s": round(total / pd_s, 1),
        "pair_ratios": [round(x, 2) for x in pair_ratios],
        "speedup": round(statistics.median(pair_ratios), 2),  # median of paired ratios
        "speedup_of_medians": round(hf_s / pd_s, 2),
        "identical_outputs": f"{same}/{len(prompts)}",
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if hf_alt_threads:
        alt = times["hf_alt"]
        best = [min(a, b) for a, b in zip(hf_times, alt, strict=True)]
        row.update({
            "hf_alt_threads": hf_alt_threads,
            "hf_alt_seconds": [round(t, 3) for t in alt],
            "speedup_vs_hf_alt_threads": round(statistics.median(
                [a / p for a, p in zip(alt, pd_times, strict=True)]), 2),
            "speedup_vs_hf_best_threads": round(statistics.median(
                [b / p for b, p in zip(best, pd_times, strict=True)]), 2),
            "hf_alt_identical_outputs": tokens["hf_alt"] == hf_tokens,
        })
    if compile:
        pdc_times = times["pdc"]
        row.update({
            "compile_warmup_seconds": round(compile_s, 1),
            "pdserve_compiled_seconds": [round(t, 3) for t in pdc_times],
            "compiled_pair_ratios": [round(h / p, 2) for h, p in
                                     zip(hf_times, pdc_times, strict=True)],
            "speedup_compiled": round(statistics.median(
                [h / p for h, p in zip(hf_times, pdc_times, strict=True)]), 2),
            "compiled_identical_outputs": tokens["pdc"] == pd_tokens,
        })
    print(f"{name:>6} batch={len(prompts):>3}: HF {row['hf_output_tok_per_s']:>8} tok/s  "
          f"pdserve {row['pdserve_output_tok_per_s']:>8} tok/s  ratio {row['speedup']}x "
          f"(pairs {row['pair_ratios']})  identical {row['identical_outputs']}  "
          f"load {row['load_avg_1min']}", flush=True)
    if hf_alt_threads:
        print(f"{'':>6} control: HF at {hf_alt_threads} thread(s) {row['hf_alt_seconds']} s; "
              f"ratio vs it {row['speedup_vs_hf_alt_threads']}x, vs HF's better setting per "
              f"pair {row['speedup_vs_hf_best_threads']}x", flush=True)
    if compile:
        print(f"{'':>6} compiled: {row['pdserve_compiled_seconds']} s; ratio "
              f"{row['speedup_compiled']}x (pairs {row['compiled_pair_ratios']}); warm-up "
              f"(compile) {row['compile_warmup_seconds']} s; same tokens as eager "
              f"{row['compiled_identical_outputs']}", flush=True)
    return row


# ---- where a step's time goes, and the bandwidth limit ------------------------------

_CATEGORIES = [  # (category, substrings of aten op names), first match wins
    ("attention", ("scaled_dot_product", "flash_attention", "softmax", "aten::bmm",
                   "aten::baddbmm")),
    ("matmul", ("linear_pointwise", "aten::mm", "aten::addmm", "aten::matmul", "aten::linear",
                "skinny_matmul")),
    ("kv_write_gather", ("index_select", "index_copy", "index_put", "aten::index")),
    ("norm", ("rms_norm",)),
    ("elementwise", ("aten::mul", "aten::add", "aten::silu", "aten::neg", "aten::cat",
                     "aten::sub", "aten::copy_", "aten::where")),
]


def _categorise(prof) -> tuple[dict[str, float], dict[str, float]]:
    """Self CPU seconds per category, and per op, from a torch.profiler run."""
    out: dict[str, float] = {c: 0.0 for c, _ in _CATEGORIES}
    out["other_ops"] = 0.0
    ops: dict[str, float] = {}
    for ev in prof.key_averages():
        cat = next((c for c, keys in _CATEGORIES if any(k in ev.key for k in keys)), "other_ops")
        out[cat] += ev.self_cpu_time_total / 1e6
        ops[ev.key] = ev.self_cpu_time_total / 1e6
    return out, ops


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Best-of copy bandwidth of one large fp32 tensor (counts read + write bytes) and
    read-only bandwidth (a sum). The weights of a decode step are read, not written,
    so the read figure is the one the limit uses."""
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    copy_s = read_s = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        copy_s = min(copy_s, time.perf_counter() - t)
        t = time.perf_counter()
        a.sum()
        read_s = min(read_s, time.perf_counter() - t)
    return {"tensor_bytes": nbytes, "copy_GBps_read_plus_write": round(2 * nbytes / copy_s / 1e9, 2),
            "read_GBps": round(nbytes / read_s / 1e9, 2)}


def _prefill_matmul_flops(model, batch: int, prompt_len: int) -> int:
    """Matmul FLOPs of one prefill step of ``batch`` prompts: every token through every
    layer's q|k|v; the other matmuls of the last layer and the LM head only at the
    ``batch`` rows that sample (see ``CausalLM.forward``'s ``keep``)."""
    tokens = batch * prompt_len
    last = model.model.layers[-1]
    kept_only = [last.self_attn.o, last.mlp.gate_up, last.mlp.down, model.logits_proj]
    kept_params = sum(m.in_features * m.out_features for m in kept_only)
    all_params = sum(m.in_features * m.out_features for m in model.modules()
                     if hasattr(m, "in_features") and hasattr(m, "panels"))
    return 2 * (tokens * (all_params - kept_params) + batch * kept_params)


def _phase_rates(phases: dict, weight_bytes: int, kv_bytes: int) -> dict:
    """GB/s of the C decode step's matmul phases (weights) and attention (K/V), from
    thread 0's phase times (barrier waits excluded)."""
    if not phases.get("steps"):
        return {}
    work = phases["work"]
    matmul_ms = sum(work[p] for p in ("qkv", "o_proj", "gate_up", "down"))
    return {"decode_kernel_matmul_ms": round(matmul_ms, 2),
            "decode_kernel_matmul_GBps": round(weight_bytes / matmul_ms / 1e6, 1),
            "decode_kernel_attention_GBps": round(kv_bytes / work["attention"] / 1e6, 1)}


def weight_read_bytes(model) -> int:
    """What one decode step must read at least: every matmul weight and norm once (a
    step reads only its rows of the embedding)."""
    return model.matmul_weight_bytes() + sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)


def _run_steps(eng, prompts: list[list[int]], params, profiled: bool) -> tuple[dict, dict]:
    """Every prompt through the engine to the end: the steps' wall times per kind and,
    when `profiled`, each step's (wall, categories, ops) from torch.profiler."""
    for i, p in enumerate(prompts):
        eng.add_request(f"a{profiled}-{i}", p, params)
    walls: dict[str, list[float]] = {"prompt": [], "decode": []}
    profs: dict[str, list] = {}
    while eng.has_work():
        if profiled:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = eng.step()
        else:
            out = eng.step()
        if not out.num_scheduled_tokens:
            continue  # the scheduler's empty vote steps (no model call, ~10 us)
        walls[out.kind].append(out.duration_s)
        if profiled:
            profs.setdefault(out.kind, []).append((out.duration_s, *_categorise(prof)))
    return walls, profs


def _mean_breakdown(profs: dict, kind: str) -> dict:
    """Mean ms per step of each op category and the top ops, of the profiled steps of
    `kind`."""
    rows = profs.get(kind, [])
    if not rows:
        return {}
    out = {k: round(1000 * statistics.mean(r[1][k] for r in rows), 2) for k in rows[0][1]}
    out["sum_of_ops"] = round(sum(out.values()), 2)
    out["profiled_step_wall"] = round(1000 * statistics.mean(r[0] for r in rows), 2)
    # The C decode step (kernels/decode_step) is one call, not an aten op: it is
    # most of this remainder in decode steps (its phases are timed separately).
    out["outside_aten_ops"] = round(out["profiled_step_wall"] - out["sum_of_ops"], 2)
    ops: dict[str, float] = {}
    for r in rows:
        for k, v in r[2].items():
            ops[k] = ops.get(k, 0.0) + v / len(rows)
    out["top_ops"] = {k: round(1000 * v, 2) for k, v in
                      sorted(ops.items(), key=lambda kv: -kv[1])[:8]}
    return out


def analyse(model_dir: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Profile a pdserve run step by step (the prefill step; the decode steps) and
    compare the decode step with reading the weights once at measured bandwidth."""
    llm = LLM(model_dir, max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    eng = llm.engines[0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[p[:16] for p in prompts[:2]],
                 sampling_params=SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)

    runner = eng.runner
    kernel = getattr(runner.model, "_kernel", None)  # the C decode step, when it is on
    _run_steps(eng, prompts, params, False)  # lets the thread tuner settle on this run's shapes
    if kernel is not None:
        kernel.step.start_profile()
    walls, _ = _run_steps(eng, prompts, params, False)  # wall times without profiler overhead
    phases = kernel.step.stop_profile() if kernel is not None else {}
    _, profs = _run_steps(eng, prompts, params, True)
    bw = measure_bandwidth()
    weight_bytes = weight_read_bytes(runner.model)
    cfg = runner.config
    b, ctx = len(prompts), len(prompts[0]) + max_tokens // 2
    kv_bytes = 2 * cfg.num_layers * b * ctx * cfg.num_kv_heads * cfg.head_dim * 4
    decode_s = statistics.median(walls["decode"])
    prefill_s = statistics.median(walls["prompt"])
    limit_s = weight_bytes / (bw["read_GBps"] * 1e9)
    limit_kv_s = (weight_bytes + kv_bytes) / (bw["read_GBps"] * 1e9)

    result = {
        "note": "breakdowns: self CPU ms per step by op category on the main thread, from "
                "torch.profiler (a separate, profiled run); *_ms: wall, unprofiled",
        "prefill_step_ms": round(1000 * prefill_s, 1),
        "decode_step_ms_median": round(1000 * decode_s, 2),
        "prefill_breakdown_ms_self_cpu": _mean_breakdown(profs, "prompt"),
        "decode_breakdown_ms_self_cpu": _mean_breakdown(profs, "decode"),
        "bandwidth": bw,
        "weight_bytes_read_per_decode_step": weight_bytes,
        "kv_bytes_read_per_decode_step_mid_run": kv_bytes,
        "weights_once_at_read_bw_ms": round(1000 * limit_s, 2),
        "weights_plus_kv_at_read_bw_ms": round(1000 * limit_kv_s, 2),
        "decode_step_over_bandwidth_limit": round(decode_s / limit_s, 2),
        "decode_kernel_phases_ms": phases,
        **_phase_rates(phases, weight_bytes, kv_bytes),
        "decode_flops": 2 * b * weight_bytes // 4,
        "decode_GFLOPS_achieved": round(2 * b * weight_bytes / 4 / decode_s / 1e9, 1),
        "prefill_GFLOPS_achieved": round(_prefill_matmul_flops(runner.model, b, len(prompts[0]))
                                         / prefill_s / 1e9, 1),
        "thread_tuner_s_per_token": {f"{k[0]}/under_2^{k[1]}_tokens/{k[2]}_threads": round(v * 1e6, 1)
                                     for k, v in runner.backend.threads.cost.items()},
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    print("analysis:", json.dumps(result, indent=1), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face folder (default: the built-in tiny and small models)")
    parser.add_argument("--prompts", help="JSON file: a list of token-id lists (default: random ids)")
    parser.add_argument("--batch", type=int, nargs="+", default=[16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=3, help="HF/pdserve pairs per case")
    parser.add_argument("--hf-alt-threads", type=int, default=1,
                        help="also time HF at this thread count as a control (0: off)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: CPU seconds of the process (use with --threads 1)")
    parser.add_argument("--quick", action="store_true", help="tiny model only, 2 pairs, no analysis")
    parser.add_argument("--analyse", action=argparse.BooleanOptionalAction, default=None,
                        help="profile + bandwidth analysis (default: on for the small model)")
    parser.add_argument("--compile", action="store_true",
                        help="also time pdserve with LLM(compile=True) (decode blocks compiled)")
    parser.add_argument("--out", default="results/bench_offline.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = ["tiny"], 2
        args.analyse = False if args.analyse is None else args.analyse
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    if args.model:
        models = [(Path(args.model).name, args.model)]
    else:
        root = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
        models = []
        for size in args.sizes:
            make_tiny_model(root / size, variant="llama", size=size)
            models.append((size, str(root / size)))

    rows, analyses = [], {}
    for name, model_dir in models:
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        for batch in args.batch:
            if args.prompts:
                prompts = json.loads(Path(args.prompts).read_text())[:batch]
            else:
                prompts = make_prompts(vocab, batch, args.prompt_len)
            alt = args.hf_alt_threads if args.hf_alt_threads != args.threads else 0
            rows.append(run_case(name, model_dir, prompts, args.max_tokens, args.repeats, alt,
                                 args.compile))
            want = args.analyse if args.analyse is not None else name == "small"
            if want and name not in analyses:
                analyses[name] = {"batch": batch, **analyse(model_dir, prompts, args.max_tokens)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "offline", "threads": args.threads, "clock": args.clock,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpu_count": os.cpu_count(),
        "results": rows, "analysis": analyses}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
