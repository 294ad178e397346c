"""The KV hand-off's share of the time to the second token, through the real service:
two `pdserve serve` processes (1 prefill + 1 decode rank each), one with KV streaming
on and one with it off, given the same fresh prompts in turn (`pdserve bench
kv-transfer --prompt-tokens ...`).
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.bench.routers import subprocess_router
from pdserve.engine.model.catalog import tiny_model_dir
from pdserve.engine.model.tiny import make_tiny_model
from pdserve.router.client import Client

MIB = 1 << 20
LONG_CONTEXT = 32768  # the built-in model, copied with a context that fits 16k prompts


def long_context_model(size: str = "tiny") -> str:
    """The built-in model (``size``: tiny, or small: 768 x 12 layers) with a context of
    LONG_CONTEXT (same weights otherwise), made once into the model cache."""
    path = tiny_model_dir().with_name(f"{size}-llama-{LONG_CONTEXT}")
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, size=size, max_position_embeddings=LONG_CONTEXT)
    return str(path)


def _share_config(model_dir: str, max_tokens: int, chunk_tokens: int, folder: str) -> str:
    """A `pdserve serve --config` file: 1 prefill + 1 decode rank that hold one such
    prompt, prefilling ``chunk_tokens`` a step."""
    engine = dict(num_kv_blocks=max_tokens // 16 + 64, max_num_seqs=4, block_size=16,
                  max_num_batched_tokens=chunk_tokens, max_model_len=max_tokens + 64)
    config = {"model_dir": model_dir, "engine": engine,
              "prefill": {"replicas": 1, "num_cpus": 0.5, "resources": {"prefill": 1}},
              "decode": {"replicas": 1, "num_cpus": 0.5, "resources": {"decode": 1}}}
    path = Path(folder) / "share.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def _time_to_second_token(address: str, prompt: list[int]) -> dict:
    # More tokens than the two timed: with a direct hand-off the decode rank starts at
    # once, and a request that ended before the router had booked its delivery would
    # carry no delivery time in its timings.
    max_tokens = 8
    with Client(address, timeout=600) as client:
        start = time.perf_counter()
        stamps, last = [], None
        for msg in client.stream(prompt, max_tokens=max_tokens, temperature=0,
                                 ignore_eos=True):
            now = time.perf_counter()
            stamps += [now] * len(msg.token_ids)
            last = msg
    if last is None or last.finish_reason != "length" or len(stamps) != max_tokens:
        raise RuntimeError(f"a {len(prompt)}-token prompt did not give {max_tokens} tokens: "
                           f"{getattr(last, 'finish_reason', None)} {getattr(last, 'error', '')}")
    t = last.timings
    # The hand-off whole (kv_handoff_span_ms): from the first token sampled on the prefill
    # rank to the decode rank's import done, on the two ranks' clocks (one node): the
    # export, the report to the router, its delivery and the import. Its parts as the
    # ranks and the router time them: export (the prefill rank's gather into its
    # transport's buffer) and deliver (the router's delivery, the import inside it).
    if t.kv_handoff_span_ms <= 0:
        raise RuntimeError("the router did not time the hand-off's span (kv_handoff_span_ms)")
    return {"ttft_s": stamps[0] - start, "ttst_s": stamps[1] - start,
            "first_to_second_s": stamps[1] - stamps[0],
            "export_s": t.kv_export_ms / 1e3, "deliver_s": t.kv_handoff_ms / 1e3,
            "handoff_s": t.kv_handoff_span_ms / 1e3, "kv_bytes": t.kv_bytes}


def measure_handoff_share(prompt_tokens: list[int], repeats: int, chunk_tokens: int = 512,
                          model_size: str = "tiny") -> dict:
    """Per prompt length, with KV streaming on and off (two `pdserve serve` processes of
    1 prefill + 1 decode rank, ray transport, side by side, alternating; fresh random
    prompts: no cache hits): the time to the first and second token at a client, the
    router's hand-off time, and the hand-off's share of the time to the second token."""
    model = long_context_model(model_size)
    rng = random.Random(0)
    modes = {"streamed": (), "whole": ("--no-kv-streaming",)}
    runs: dict = {mode: {n: [] for n in prompt_tokens} for mode in modes}
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        config = _share_config(model, max(prompt_tokens), chunk_tokens, folder)
        # both started before either is waited for: their start-ups overlap; each is
        # stopped when the stack closes, however far it came
        routers = {mode: stack.push(subprocess_router(
            {"mode": "disaggregated", "prefill": 1, "decode": 1}, model=model,
            extra_args=("--config", config, *flags)).start()) for mode, flags in modes.items()}
        addresses = {mode: router.address() for mode, router in routers.items()}
        for n in prompt_tokens:
            for i in range(repeats + 1):  # the first of each is a warm-up
                for mode, address in addresses.items():
                    prompt = [1] + [rng.randrange(3, 4000) for _ in range(n - 1)]
                    row = _time_to_second_token(address, prompt)
                    if i:
                        runs[mode][n].append(row)
            print(f"  {n} tokens: done", flush=True)
    med = statistics.median
    out: dict = {"prompt_tokens": list(prompt_tokens), "chunk_tokens": chunk_tokens,
                 "repeats": repeats, "model_size": model_size, "modes": {}}
    for mode, by_n in runs.items():
        rows = out["modes"][mode] = {}
        for key in ("ttft_s", "ttst_s", "first_to_second_s", "export_s", "deliver_s",
                    "handoff_s", "kv_bytes"):
            rows[key] = [med(r[key] for r in by_n[n]) for n in prompt_tokens]
        rows["handoff_share_of_ttst"] = [med(r["handoff_s"] / r["ttst_s"] for r in by_n[n])
                                         for n in prompt_tokens]
        rows["requests"] = [by_n[n] for n in prompt_tokens]  # every timed request, in order
    return out


def format_share(share: dict) -> str:
    lines = [f"hand-off share of the time to the second token ({share['model_size']} model, "
             f"prefill chunks of {share['chunk_tokens']} tokens; medians, ms; hand-off = "
             "first token sampled -> imported on the decode rank (export, report, deliver, "
             "import); streamed: the last payload's, its chunks went during the prefill):",
             f"{'tokens':>8} {'mode':>9} {'TTFT':>8} {'to 2nd':>8} {'1st->2nd':>9} "
             f"{'export':>7} {'deliver':>8} {'hand-off':>9} {'share':>6} {'KV MiB':>7}"]
    for i, n in enumerate(share["prompt_tokens"]):
        for mode, rows in share["modes"].items():
            lines.append(f"{n:>8} {mode:>9} {1e3 * rows['ttft_s'][i]:>8.1f} "
                         f"{1e3 * rows['ttst_s'][i]:>8.1f} {1e3 * rows['first_to_second_s'][i]:>9.1f} "
                         f"{1e3 * rows['export_s'][i]:>7.1f} {1e3 * rows['deliver_s'][i]:>8.1f} "
                         f"{1e3 * rows['handoff_s'][i]:>9.1f} {rows['handoff_share_of_ttst'][i]:>6.2f} "
                         f"{rows['kv_bytes'][i] / MIB:>7.2f}")
        streamed, whole = share["modes"]["streamed"], share["modes"]["whole"]
        below = [r["first_to_second_s"] < whole["handoff_s"][i] for r in streamed["requests"][i]]
        lines.append(f"{'':>8} streamed 1st->2nd / whole hand-off: "
                     f"{streamed['first_to_second_s'][i] / whole['handoff_s'][i]:.2f} "
                     f"({sum(below)} of {len(below)} streamed requests below it); "
                     f"/ its deliver alone: "
                     f"{streamed['first_to_second_s'][i] / whole['deliver_s'][i]:.2f}")
    return "\n".join(lines)
