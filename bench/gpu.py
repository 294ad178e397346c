"""pdserve on a GPU beside its bandwidth roofline: random-weight Llama shapes, decode and prefill.

    pdserve bench gpu                                   # 1B and 8B shapes, batch 1/16/64/256
    pdserve bench gpu --shapes llama-1b --batches 1,64 --no-hf
    pdserve bench gpu --device cpu --shapes cpu-smoke --batches 1,2 --out 8   # the bench itself

Models are made from a shape (random bf16 weights: speed does not depend on the values;
nothing is downloaded) and served by the offline ``LLM`` with its defaults for the
device (on CUDA: the GPU backend, its graphs and fused ops). For each shape and batch:
decode tok/s (``--prompt`` tokens in, ``--out`` out, EOS ignored) against the roofline
measured in the same run (batch x copy bandwidth / bytes a step reads: every weight
once, an untied input embedding only by rows, plus each row's KV), and transformers'
``generate`` beside it (``--no-hf`` leaves it out); prefill tok/s and MFU at 8 x 2,048;
kernel launches and host syncs per decoded token and the GPU-busy fraction (torch
profiler); the decode graphs' capture time and memory. Writes JSON
(``results/bench_gpu.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.model.tiny import make_tiny_model
from pdserve.scheduler.sampling_params import SamplingParams

SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     tie_word_embeddings=True, head_dim=64),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     tie_word_embeddings=False, head_dim=128),
    "cpu-smoke": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                      tie_word_embeddings=True, head_dim=64),
}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")  # cudaMemcpyAsync from pageable memory shows as cudaMemcpy*
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaLaunchKernelExC",
                "cuLaunchKernelEx")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default="llama-1b,llama-8b",
                   help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens of a decode run")
    p.add_argument("--out", type=int, default=128, help="tokens out of a decode run")
    p.add_argument("--prefill", default="8x2048", help="PROMPTSxTOKENS of the prefill run; "
                   "'none' skips it")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="the matmul peak MFU is counted against (an H200's measured bf16)")
    p.add_argument("--no-hf", action="store_true", help="leave transformers' generate out")
    p.add_argument("--kv-mb", type=int, default=None,
                   help="KV cache budget (default: what the largest batch needs, doubled)")
    p.add_argument("--budget-s", type=float, default=600.0,
                   help="stop starting new measurements after this many seconds")
    p.add_argument("--models", default="/tmp/pdserve_bench_models")
    p.add_argument("--json", default="results/bench_gpu.json")


def make_model(folder: Path, shape: str, dev: torch.device) -> int:
    """A random-weight bf16 Llama folder of ``shape``; returns the bytes a decode step
    reads of its weights."""
    # lazy: safetensors, only to write a model (`pdserve --help` imports this module)
    from safetensors.torch import save_file

    s = SHAPES[shape]
    make_tiny_model(folder)  # tokenizer files; config and weights replaced below
    h, i, n_layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    hq, hk, d, vocab = (s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"],
                        s["vocab_size"])
    gen = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device=dev).normal_(
            0, 0.02, generator=gen).cpu()

    sd = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h).bfloat16()}
    if not s["tie_word_embeddings"]:
        sd["lm_head.weight"] = w(vocab, h)
    for n in range(n_layers):
        p = f"model.layers.{n}."
        sd |= {p + "self_attn.q_proj.weight": w(hq * d, h), p + "self_attn.k_proj.weight": w(hk * d, h),
               p + "self_attn.v_proj.weight": w(hk * d, h), p + "self_attn.o_proj.weight": w(h, hq * d),
               p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
               p + "mlp.down_proj.weight": w(h, i),
               p + "input_layernorm.weight": torch.ones(h).bfloat16(),
               p + "post_attention_layernorm.weight": torch.ones(h).bfloat16()}
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
                  attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2,
                  dtype="bfloat16", **s)
    (folder / "config.json").write_text(json.dumps(config))
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sum(v.numel() * v.element_size() for k, v in sd.items()
               if s["tie_word_embeddings"] or "embed_tokens" not in k)


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes read plus written per second by a device copy of 1 GiB (256 MiB on CPUs)."""
    n = (1 << 30) if dev.type == "cuda" else (1 << 28)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(dev)
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    _sync(dev)
    return 2 * 10 * n / (time.perf_counter() - start)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _prompts(batch: int, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(10, 4000, (n - 1,), generator=g).tolist() for _ in range(batch)]


def timed_generate(llm, dev, batch: int, prompt: int, out: int) -> tuple[float, float]:
    """(output tok/s, seconds) of one offline generate."""
    sp = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    ps = _prompts(batch, prompt)
    _sync(dev)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=ps, sampling_params=sp, use_tqdm=False)
    _sync(dev)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, seconds


def step_profile(llm, dev, batch: int, out: int = 32) -> dict:
    """Launches and host syncs per decoded token, and the GPU-busy fraction, over a
    generate of ``out`` tokens at ``batch`` (its prefill step included)."""
    if dev.type != "cuda":
        return {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, seconds = timed_generate(llm, dev, batch, 16, out)
    events = prof.events()
    launches = sum(1 for e in events if e.name in LAUNCH_CALLS)
    syncs = sum(1 for e in events if e.name.startswith(SYNC_CALLS) and "Async" not in e.name
                or e.name == "cudaStreamSynchronize")
    busy_us = sum(e.device_time for e in events
                  if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return dict(launches_per_token=launches / out, syncs_per_token=syncs / out,
                gpu_busy=busy_us / 1e6 / seconds)


def hf_tok_s(folder: Path, dev, batch: int, prompt: int, out: int) -> float:
    # lazy: transformers is heavy; only the HF comparison needs it
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                             attn_implementation="sdpa").to(dev).eval()
    m.generation_config.eos_token_id = None
    ids = torch.tensor(_prompts(batch, prompt), device=dev)
    with torch.inference_mode():
        m.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        _sync(dev)
        start = time.perf_counter()
        res = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out,
                         do_sample=False, pad_token_id=0)
        _sync(dev)
        seconds = time.perf_counter() - start
    del m
    return (res.shape[1] - prompt) * batch / seconds


def _free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def bench_shape(args, shape: str, dev: torch.device, bandwidth: float, deadline: float,
                emit) -> None:
    # lazy: engine.llm, only when a shape runs (`pdserve --help` imports this module)
    from pdserve import LLM

    folder = Path(args.models) / shape
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    weight_bytes = make_model(folder, shape, dev)
    emit(what="model", shape=shape, weight_bytes=weight_bytes, make_s=time.perf_counter() - start)
    s = SHAPES[shape]
    kv_per_token = 2 * s["num_key_value_heads"] * s["head_dim"] * 2 * s["num_hidden_layers"]
    batches = [int(b) for b in args.batches.split(",")]
    n_prompts, prompt_len = ((0, 0) if args.prefill == "none"
                             else map(int, args.prefill.split("x")))
    need = max(max(batches) * (args.prompt + args.out + 16), n_prompts * (prompt_len + 16))
    kv_mb = args.kv_mb or max(256, 2 * need * kv_per_token >> 20)
    start = time.perf_counter()
    llm = LLM(str(folder), device=dev.type, dtype="bfloat16", kv_cache_memory_mb=kv_mb,
              max_num_seqs=max(batches + [n_prompts]))
    runner = llm.engines[0].runner
    graphs = getattr(runner.backend, "graphs", None)
    emit(what="load", shape=shape, s=time.perf_counter() - start, backend=runner.backend.name,
         graph_capture_s=getattr(graphs, "capture_seconds", None),
         graph_capture_mib=(graphs.capture_bytes / 2**20
                            if graphs is not None and graphs.capture_bytes is not None else None))
    timed_generate(llm, dev, 2, 64, 4)  # warm-up
    for b in batches:
        if time.time() > deadline:
            emit(what="skipped", shape=shape, batch=b, why="--budget-s")
            continue
        row = dict(what="decode", shape=shape, batch=b, prompt=args.prompt, out=args.out,
                   roofline_tok_s=b * bandwidth / (
                       weight_bytes + b * (args.prompt + args.out / 2) * kv_per_token))
        row["pdserve_tok_s"], row["pdserve_s"] = timed_generate(llm, dev, b, args.prompt, args.out)
        row["pdserve_vs_roofline"] = row["pdserve_tok_s"] / row["roofline_tok_s"]
        row |= step_profile(llm, dev, b)
        emit(**row)
    if n_prompts and time.time() < deadline:
        tok_s, seconds = timed_generate(llm, dev, n_prompts, prompt_len, 1)
        flops = 2 * (weight_bytes / 2) * n_prompts * prompt_len  # 2 x multiplied params x tokens
        emit(what="prefill", shape=shape, prompts=n_prompts, prompt_len=prompt_len, s=seconds,
             prompt_tok_s=n_prompts * prompt_len / seconds,
             mfu=flops / seconds / (args.peak_tflops * 1e12) if dev.type == "cuda" else None)
    del llm, runner, graphs
    _free(dev)
    if not args.no_hf:
        for b in batches:
            if time.time() > deadline:
                break
            emit(what="transformers", shape=shape, batch=b,
                 tok_s=hf_tok_s(folder, dev, b, args.prompt, args.out))
            _free(dev)
    shutil.rmtree(folder, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    dev = torch.device(args.device)
    deadline = time.time() + args.budget_s
    rows: list[dict] = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    bandwidth = copy_bandwidth(dev)
    emit(what="bandwidth", device=str(dev), bytes_per_s=bandwidth,
         name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        if time.time() > deadline:
            emit(what="skipped", shape=shape, why="--budget-s")
            continue
        bench_shape(args, shape, dev, bandwidth, deadline, emit)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    hf = {(r["shape"], r["batch"]): r["tok_s"] for r in rows if r["what"] == "transformers"}
    print(f"\n{'shape':10} {'batch':>5} {'tok/s':>9} {'roofline':>9} {'ratio':>6} "
          f"{'launch/tok':>10} {'sync/tok':>8} {'busy':>5} {'hf tok/s':>9}")
    for r in rows:
        if r["what"] != "decode":
            continue
        hf_s = hf.get((r["shape"], r["batch"]))
        print(f"{r['shape']:10} {r['batch']:5d} {r['pdserve_tok_s']:9.1f} "
              f"{r['roofline_tok_s']:9.1f} {r['pdserve_vs_roofline']:6.1%} "
              f"{r.get('launches_per_token', float('nan')):10.1f} "
              f"{r.get('syncs_per_token', float('nan')):8.1f} {r.get('gpu_busy', float('nan')):5.0%} "
              f"{'' if hf_s is None else f'{hf_s:9.1f}'}")
    for r in rows:
        if r["what"] == "prefill":
            mfu = "" if r["mfu"] is None else f", MFU {r['mfu']:.1%}"
            print(f"prefill {r['shape']} {r['prompts']}x{r['prompt_len']}: "
                  f"{r['prompt_tok_s']:.0f} prompt tok/s{mfu}")
