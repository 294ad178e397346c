"""Offline throughput: pdserve's NORMAL engine against Hugging Face `generate`.

Same checkpoint, same prompts, greedy, fp32, measured in one run so the ratio is
meaningful on a noisy shared machine. Writes JSON (default results/bench_offline.json).

    python bench/offline.py                      # tiny and small built-in models, batch 16
    python bench/offline.py --model DIR --prompts ids.json --batch 16 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch


def make_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids, where the special tokens live.
    return [[rng.randrange(8, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


def bench_hf(model_dir: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
    return elapsed, out[:, ids.shape[1]:].tolist()


def bench_pdserve(model_dir: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from pdserve import LLM, SamplingParams

    llm = LLM(model_dir, max_num_seqs=max(len(prompts), 1), max_num_batched_tokens=4096)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=2, temperature=0.0),
                 use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [o.token_ids for o in outs]


def run_case(name: str, model_dir: str, prompts: list[list[int]], max_tokens: int) -> dict:
    hf_s, hf_tokens = bench_hf(model_dir, prompts, max_tokens)
    pd_s, pd_tokens = bench_pdserve(model_dir, prompts, max_tokens)
    total = len(prompts) * max_tokens
    same = sum(a == b for a, b in zip(hf_tokens, pd_tokens, strict=True))
    row = {
        "model": name, "batch": len(prompts), "prompt_len": len(prompts[0]), "output_len": max_tokens,
        "hf_seconds": round(hf_s, 3), "pdserve_seconds": round(pd_s, 3),
        "hf_output_tok_per_s": round(total / hf_s, 1), "pdserve_output_tok_per_s": round(total / pd_s, 1),
        "speedup": round(hf_s / pd_s, 2), "identical_outputs": f"{same}/{len(prompts)}",
    }
    print(f"{name:>6} batch={len(prompts):>3}: HF {row['hf_output_tok_per_s']:>8} tok/s  "
          f"pdserve {row['pdserve_output_tok_per_s']:>8} tok/s  ratio {row['speedup']}x  "
          f"identical {row['identical_outputs']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face folder (default: the built-in tiny and small models)")
    parser.add_argument("--prompts", help="JSON file: a list of token-id lists (default: random ids)")
    parser.add_argument("--batch", type=int, nargs="+", default=[16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="results/bench_offline.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.model:
        models = [(Path(args.model).name, args.model)]
    else:
        from pdserve.engine.tiny_model import make_tiny_model

        root = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
        models = []
        for size in args.sizes:
            make_tiny_model(root / size, variant="llama", size=size)
            models.append((size, str(root / size)))

    rows = []
    for name, model_dir in models:
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        for batch in args.batch:
            if args.prompts:
                prompts = json.loads(Path(args.prompts).read_text())[:batch]
            else:
                prompts = make_prompts(vocab, batch, args.prompt_len)
            rows.append(run_case(name, model_dir, prompts, args.max_tokens))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "offline", "threads": args.threads, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
