"""GPU check: the runner on CUDA (its default backend: paged attention, fused ops, decode
graphs) equals transformers (fp32 greedy, logits; bf16 greedy wherever transformers' top-2
margin exceeds a tolerance, the margins shown), the kernel benchmark's headline ratios,
``pdserve bench gpu`` (decode tok/s against the bandwidth roofline, prefill MFU,
launches and syncs per token), and the ``device`` KV transport's bandwidth
between two processes at 16/64/256 MiB against a device memcpy, by CUDA IPC and by a
pair group (NCCL across two GPUs; on one GPU gloo staged through the host, since NCCL
refuses two ranks on one GPU): ``device_transport`` in the summary, from
``bench/device_transport.py``. Without CUDA it says so and exits 0.

    python scripts/gpu_check.py                 # on a machine with a GPU (~1-2 min)
    python scripts/gpu_check.py --device cpu    # same checks on CPU (to test the script)
    python scripts/gpu_check.py --only-transport  # just the device transport section
    python scripts/gpu_check.py --service       # 1P+1D `pdserve serve` on this GPU (Ray)

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

from pdserve.bench import gpu  # noqa: E402
from pdserve.bench.device_transport import device_transport_check  # noqa: E402
from pdserve.bench.gpu_service import service_check  # noqa: E402
from pdserve.bench.kernels import main as bench_main  # noqa: E402
from pdserve.engine.model.tiny import make_tiny_model  # noqa: E402
from pdserve.engine.model_runner import ModelRunner, RunnerRow  # noqa: E402


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-bench", action="store_true", help="skip both benchmarks")
    ap.add_argument("--gpu-bench-s", type=float, default=240.0,
                    help="time for `pdserve bench gpu` (decode and prefill vs the roofline)")
    ap.add_argument("--shapes", default="llama-1b,llama-8b")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--no-transport", action="store_true",
                    help="skip the device KV transport's bandwidth check")
    ap.add_argument("--only-transport", action="store_true",
                    help="only the device KV transport's bandwidth check")
    ap.add_argument("--service", action="store_true",
                    help="only the service end to end: 1P+1D `pdserve serve` through Ray on "
                    "this device (bench/gpu_service.py), with the transport's bandwidth")
    ap.add_argument("--service-shape", default=None,
                    help="model shape for --service (default llama-1b on a GPU, cpu-smoke on CPU)")
    ap.add_argument("--streams", default="1,16,64", help="--service concurrencies")
    return ap.parse_args()


def _service(args: argparse.Namespace) -> int:
    """The service end to end, then the device transport between two processes."""
    dev = torch.device(args.device)
    shape = args.service_shape or ("llama-1b" if dev.type == "cuda" else "cpu-smoke")
    streams = tuple(int(s) for s in args.streams.split(","))
    summary = {"torch": torch.__version__,
               "service": service_check(args.device, shape, streams)}
    if not args.no_transport:
        summary["device_transport"] = device_transport_check(dev)
    summary["ok"] = summary["service"]["greedy_equal_offline"]
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _only_transport(device: str) -> int:
    dev = torch.device(device)
    summary = {"device": str(dev), "torch": torch.__version__,
               "device_transport": device_transport_check(dev)}
    summary["ok"] = "error" not in summary["device_transport"]
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _greedy_against_hf(hf, runner, dev: torch.device, prompts: list[list[int]]
                       ) -> tuple[float, bool]:
    """(largest logit difference over the chunked prefills, whether every greedy
    continuation equals transformers' generate)."""
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
    return worst, same


def _check_variant(variant: str, folder: str, dev: torch.device, summary: dict) -> bool:
    """One built-in model variant: fp32 equal to transformers, bf16 finite (into
    ``summary``); whether both held."""
    # lazy: transformers is heavy; only the equivalence checks need it
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(Path(folder) / variant, variant)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 4096, (n - 1,), generator=g).tolist()
               for n in (5, 40, 150)]
    runner = ModelRunner(path, device=dev, num_kv_blocks=64, num_state_slots=4)
    worst, same = _greedy_against_hf(hf, runner, dev, prompts)
    summary[f"{variant}_fp32_max_logit_diff"] = worst
    summary[f"{variant}_fp32_greedy_equal"] = same
    ok = same and worst < 1e-3
    b16 = ModelRunner(path, device=dev, dtype="bfloat16", num_kv_blocks=64, num_state_slots=4)
    lb = b16.compute_logits([RunnerRow(prompts[1], 0, [1, 2, 3], 0)])
    summary[f"{variant}_bf16_finite"] = bool(torch.isfinite(lb).all())
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
    summary[f"{variant}_bf16_vs_transformers"] = _bf16_margins(hf16, b16, dev, prompts)
    ok &= summary[f"{variant}_bf16_vs_transformers"]["ok"]
    return ok and summary[f"{variant}_bf16_finite"]


BF16_MARGIN = 0.25  # logits; a bf16 logit near 8 is 1/16 apart from its neighbours


def _bf16_margins(hf, runner, dev: torch.device, prompts: list[list[int]], n: int = 24) -> dict:
    """pdserve's bf16 greedy continuation, teacher-forced through transformers' bf16: at
    each position, does transformers' argmax equal pdserve's token, and where not, how
    close were transformers' top two? Passes when every disagreement has a top-2 margin
    under ``BF16_MARGIN``."""
    positions, differ = 0, []
    for i, p in enumerate(prompts):
        table = list(range(1 + 12 * i, 13 + 12 * i))
        got = runner.execute([RunnerRow(p, 0, table, i)])
        while len(got) < n:
            got += runner.execute([RunnerRow([got[-1]], len(p) + len(got) - 1, table, i,
                                             output_index=len(got))])
        with torch.no_grad():
            logits = hf(torch.tensor([p + got[:-1]], device=dev)).logits[0, len(p) - 1:].float()
        top2 = logits.topk(2, dim=-1)
        for j, token in enumerate(got):
            positions += 1
            if int(top2.indices[j, 0]) != token:
                differ.append(round(float(top2.values[j, 0] - top2.values[j, 1]), 4))
    return {"positions": positions, "differ": len(differ), "margins_where_differ": differ,
            "tolerance": BF16_MARGIN, "ok": all(m < BF16_MARGIN for m in differ)}


def _gpu_bench(args: argparse.Namespace, dev: torch.device) -> list[dict]:
    """``pdserve bench gpu`` within ``--gpu-bench-s``; its rows (results/bench_gpu.json)."""
    p = argparse.ArgumentParser()
    gpu.add_args(p)
    shapes = args.shapes if dev.type == "cuda" else "cpu-smoke"
    out = Path("results") / "bench_gpu.json"
    gpu.run(p.parse_args(["--device", str(dev), "--shapes", shapes, "--batches", args.batches,
                          "--budget-s", str(args.gpu_bench_s), "--json", str(out)]
                         + ([] if dev.type == "cuda" else ["--out", "8", "--prefill", "2x64"])))
    return json.loads(out.read_text())


def main() -> int:
    args = _parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    if args.only_transport:
        return _only_transport(args.device)
    if args.service:
        return _service(args)
    dev = torch.device(args.device)
    summary: dict = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(dev)
    ok = True
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("llama", "mistral-swa"):
            ok &= _check_variant(variant, tmp, dev, summary)
    summary["equivalence_seconds"] = round(time.time() - t0, 1)
    if not args.no_bench:
        out = Path("results") / f"bench_kernels_{dev.type}.json"
        bench_main(["--device", str(dev), "--out", str(out)])
        summary["bench"] = json.loads(out.read_text())["summary"]
        summary["gpu_bench"] = _gpu_bench(args, dev)
    if not args.no_transport:
        summary["device_transport"] = device_transport_check(dev)
        ok &= "error" not in summary["device_transport"]
    summary["ok"] = ok
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
