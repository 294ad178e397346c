"""Where cost models come from: a real engine measured here, or a measured run's
step timeline.

``measure_engine`` (how the built-in ``tiny_cpu.json`` was made: ``python -m
pdserve.simulator.calibrate``) drives a real ``LLMEngine`` on the tiny built-in model
in this process (2 repeats) and times whole ``step()`` calls (scheduling included, as a rank's
timeline does): prompt steps of 1 and 4 rows of 16..1024 new positions, chunked
prompts (new positions after 256..1536 cached ones), and decode steps of 1..64 rows
at contexts of 32..1536 tokens; then fits the models of ``cost_model.py``. The
hand-off model is fitted to the Ray shared-memory hand-off times of
``results/bench_kv_transfer.json`` (``pdserve bench kv-transfer``).

``fit_timeline`` fits from ``pdserve bench serve --timeline FILE.png``'s FILE.json
(``rank/step_timeline.py`` records): those records carry a step's new positions and
rows but neither each row's cached prefix nor a decode step's context, so a prompt
step's rows count as equal and uncached (``e`` = 0) and a decode step's cost as
``a + b rows`` (``c`` = 0); the hand-off model and the model facts are kept from the
base model.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from pdserve.engine.config import EngineConfig
from pdserve.engine.model.catalog import resolve_model
from pdserve.engine.model.config import ModelConfig
from pdserve.scheduler.output import StepKind
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.simulator.cost_model import (
    BUILTIN_PATH,
    CostModel,
    DecodeStepCost,
    fit_decode,
    fit_handoff,
    fit_prompt,
)

REPO = Path(__file__).resolve().parent.parent


def _timed_steps(engine, n: int) -> list[tuple]:
    """(scheduler output, seconds) of the next ``n`` steps."""
    captured = []
    schedule = engine.scheduler.schedule

    def capture():
        out = schedule()
        captured.append(out)
        return out

    engine.scheduler.schedule = capture
    steps = []
    try:
        for _ in range(n):
            if not engine.has_work():
                break
            t0 = time.perf_counter()
            engine.step()
            steps.append((captured[-1], time.perf_counter() - t0))
    finally:
        engine.scheduler.schedule = schedule
    return steps


class _Samples:
    """The timed steps kept for the fits, and the requests that make them (seeded)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.ids = iter(range(10**9))
        self.prompt: list = []  # (rows as (q, c), seconds)
        self.decode: list = []  # (rows, context, seconds)

    def add(self, engine, n_tokens: int, max_tokens: int) -> None:
        engine.add_request(f"r{next(self.ids)}", self.rng.integers(8, 4000, n_tokens).tolist(),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                          temperature=0.0))

    def keep(self, steps) -> None:
        for out, s in steps:
            rows = out.scheduled
            if not rows:
                continue
            if out.kind == StepKind.PROMPT:
                self.prompt.append(([(r.query_len, r.start_pos) for r in rows], s))
            elif out.kind == StepKind.DECODE:
                self.decode.append((len(rows), sum(r.seqlen_k for r in rows), s))


def _sample_prompt_steps(samples: _Samples, engine) -> None:
    """Prompt steps of 1 and 4 rows of 16..1024 new positions."""
    for q in (16, 64, 128, 256, 512, 1024):
        for rows in (1, 4):
            for _ in range(rows):
                samples.add(engine, q, 1)
            samples.keep(_timed_steps(engine, 100))


def _sample_decode_steps(samples: _Samples, engine) -> None:
    """Decode steps of 1..64 rows at contexts of 32..1536 tokens."""
    for batch in (1, 8, 32, 64):
        for context in (32, 512, 1536):
            for _ in range(batch):
                samples.add(engine, context, 6)
            samples.keep(_timed_steps(engine, 1000))


def measure_engine(model_dir: str, repeats: int = 3) -> tuple[list, list]:
    """Prompt samples (rows as (q, c), s) and decode samples (rows, context, s)."""
    # lazy: engine.engine imports torch; only measuring a real engine needs it
    from pdserve.engine.engine import LLMEngine

    samples = _Samples(seed=0)
    base = dict(model_dir=model_dir, engine_type="normal", enable_prefix_caching=False)
    engine = LLMEngine(EngineConfig(**base))
    for _ in range(repeats):
        _sample_prompt_steps(samples, engine)
        _sample_decode_steps(samples, engine)
    chunked = LLMEngine(EngineConfig(**base, max_num_batched_tokens=256))
    for _ in range(repeats):
        samples.add(chunked, 1792, 1)
        samples.keep(_timed_steps(chunked, 100))
    return samples.prompt, samples.decode


def handoff_samples(path: Path) -> list[tuple[int, float]]:
    """(bytes, median seconds) of each payload size's Ray hand-offs (export + deliver)."""
    d = json.loads(path.read_text())
    sec = d["seconds"]
    return [(int(mib * 2**20), statistics.median(e + v for e, v in zip(ex, de, strict=True)))
            for mib, ex, de in zip(d["sizes_mib"], sec["ray_export"], sec["ray_deliver"],
                                   strict=True)]


def kv_bytes_per_token(model: str, dtype_bytes: int = 4) -> tuple[int, int]:
    """(K and V bytes of one position over the layers that keep KV blocks, as the
    runner's cache counts them (sliding-window layers keep rings instead),
    max_model_len) of a model folder or GGUF file. ``dtype_bytes``: the cache's element,
    4 for fp32, 2 where ``kv_precision`` holds fp16 (``auto`` does for a GGUF file's
    integer blocks, engine/model_runner.kv_dtype)."""
    cfg = ModelConfig.from_model(model)
    full_layers = sum(w is None for w in cfg.layer_windows) if cfg.layer_windows \
        else cfg.num_layers
    return (2 * full_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes,
            int(cfg.max_position_embeddings))


def fit_timeline(path: str | Path, base: CostModel) -> CostModel:
    """A cost model from a timeline JSON (see the module doc)."""
    data = json.loads(Path(path).read_text())
    steps = data["steps"] if isinstance(data, dict) else data
    prompt, decode = [], []
    for s in steps:
        seconds, rows, tokens = s["end"] - s["start"], int(s["num_rows"]), int(s["num_tokens"])
        if seconds <= 0 or rows <= 0 or tokens <= 0:
            continue  # empty steps and imports say nothing about compute
        if s["kind"] == "prompt":
            q, extra = divmod(tokens, rows)
            prompt.append(([(q + (i < extra), 0) for i in range(rows)], seconds))
        elif s["kind"] == "decode":
            decode.append((rows, 0, seconds))
    if len(prompt) < 4 or len(decode) < 4:
        raise ValueError(f"{path}: {len(prompt)} prompt and {len(decode)} decode steps; "
                         "a fit needs at least 4 of each")
    d = fit_decode(decode)
    return CostModel(fit_prompt(prompt), DecodeStepCost(d.a, d.b, 0.0), base.handoff,
                     base.kv_bytes_per_token, base.max_model_len,
                     {"fitted_from": str(path), "prompt_steps": len(prompt),
                      "decode_steps": len(decode), "base": base.notes})


def main() -> None:
    model_dir = resolve_model("tiny").path  # the fitted costs are the tiny model's
    t0 = time.time()
    prompt, decode = measure_engine(model_dir, repeats=2)
    kv_bytes, max_len = kv_bytes_per_token(model_dir)
    handoff_path = REPO / "results" / "bench_kv_transfer.json"
    model = CostModel(fit_prompt(prompt), fit_decode(decode), fit_handoff(handoff_samples(
        handoff_path)), kv_bytes, max_len, {
            "model": "built-in tiny llama (fp32, CPU)",
            "how": "python -m pdserve.simulator.calibrate (simulator/calibrate.py)",
            "measured": time.strftime("%Y-%m-%d", time.gmtime(t0)),
            "prompt_steps": len(prompt), "decode_steps": len(decode),
            "handoff": "results/bench_kv_transfer.json: medians of ray_export + ray_deliver"})
    model.save(BUILTIN_PATH)
    print(f"wrote {BUILTIN_PATH} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
