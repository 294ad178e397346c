"""GPU check: the runner on CUDA equals transformers (fp32 greedy, logits), bf16 runs,
and the kernel benchmark's headline ratios. Without CUDA it says so and exits 0.

    python scripts/gpu_check.py                 # on a machine with a GPU (~1-2 min)
    python scripts/gpu_check.py --device cpu    # same checks on CPU (to test the script)

Prints one JSON summary line at the end; exit status 1 if an equivalence fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from pdserve.engine.model_runner import ModelRunner, RunnerRow
    from pdserve.engine.tiny_model import make_tiny_model
    from transformers import AutoModelForCausalLM

    dev = torch.device(args.device)
    summary: dict = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(dev)
    ok = True
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("llama", "mistral-swa"):
            path = make_tiny_model(Path(tmp) / variant, variant)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
            g = torch.Generator().manual_seed(0)
            prompts = [[1] + torch.randint(3, 4096, (n - 1,), generator=g).tolist()
                       for n in (5, 40, 150)]
            runner = ModelRunner(path, device=dev, num_kv_blocks=64, num_state_slots=4)
            worst, same = 0.0, True
            for i, p in enumerate(prompts):
                with torch.no_grad():
                    ref = hf(torch.tensor([p], device=dev)).logits[0]
                    want = hf.generate(torch.tensor([p], device=dev), max_new_tokens=12,
                                       do_sample=False, pad_token_id=2)[0, len(p):].tolist()
                table = list(range(1 + 12 * i, 13 + 12 * i))
                pos, got = 0, []
                for q in (37, 37, 1000):  # chunked prefill
                    chunk = p[pos:pos + q]
                    if not chunk:
                        break
                    lg = runner.compute_logits([RunnerRow(chunk, pos, table, i)])
                    pos += len(chunk)
                    worst = max(worst, (lg[0] - ref[pos - 1]).abs().max().item())
                got.append(int(lg[0].argmax()))
                while len(got) < len(want):
                    got += runner.execute([RunnerRow([got[-1]], pos, table, i,
                                                     output_index=len(got))])
                    pos += 1
                same &= got == want[:len(got)]
            summary[f"{variant}_fp32_max_logit_diff"] = worst
            summary[f"{variant}_fp32_greedy_equal"] = same
            ok &= same and worst < 1e-3
            b16 = ModelRunner(path, device=dev, dtype="bfloat16", num_kv_blocks=16)
            lb = b16.compute_logits([RunnerRow(prompts[1], 0, [1, 2, 3], 0)])
            summary[f"{variant}_bf16_finite"] = bool(torch.isfinite(lb).all())
            ok &= summary[f"{variant}_bf16_finite"]
    summary["equivalence_seconds"] = round(time.time() - t0, 1)
    if not args.no_bench:
        from pdserve.bench.kernels import main as bench_main

        out = Path("results") / f"bench_kernels_{dev.type}.json"
        bench_main(["--device", str(dev), "--out", str(out)])
        summary["bench"] = json.loads(out.read_text())["summary"]
    summary["ok"] = ok
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
