"""Step-cost models: how long a simulated rank's step and a KV hand-off take.

- Prompt step over rows of ``q`` new positions after ``c`` cached ones: the chunk
  sizer's model ``a + b sum(q) + d sum(q^2) + e sum(q c)`` (its features and its
  non-negative least-squares fit, ``scheduler/chunk_sizer.py``, are reused as they are).
- Decode step: ``a + b rows + c context_tokens`` (context: the keys every row reads,
  summed over rows).
- Hand-off: ``a + b bytes`` from the prefill rank's step end to the payload's arrival.

The built-in model (``tiny_cpu.json`` beside this file) was measured on this machine
with ``simulator/calibrate.py`` (see its doc); ``CostModel.load`` / ``save`` read and
write the same JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.scheduler.chunk_sizer import ChunkSizer, _fit_non_negative

BUILTIN_PATH = Path(__file__).with_name("tiny_cpu.json")


@dataclass(frozen=True)
class PromptStepCost:
    a: float  # seconds per step
    b: float  # per new position
    d: float  # per new position squared (attention within the chunk)
    e: float  # per new position x cached position (attention to the prefix)

    def seconds(self, rows: list[tuple[int, int]]) -> float:
        """``rows``: (q, c) per row, as ``ChunkSizer.features`` takes them."""
        _, sq, sq2, sqc = ChunkSizer.features(rows)
        return self.a + self.b * sq + self.d * sq2 + self.e * sqc


@dataclass(frozen=True)
class DecodeStepCost:
    a: float  # seconds per step
    b: float  # per row
    c: float  # per context token (summed over rows)

    def seconds(self, rows: int, context_tokens: int) -> float:
        return self.a + self.b * rows + self.c * context_tokens


@dataclass(frozen=True)
class HandoffCost:
    a: float  # seconds per hand-off (calls, polls, import)
    b: float  # seconds per byte

    def seconds(self, nbytes: int) -> float:
        return self.a + self.b * nbytes


@dataclass(frozen=True)
class CostModel:
    prompt: PromptStepCost
    decode: DecodeStepCost
    handoff: HandoffCost
    kv_bytes_per_token: int  # K and V of every layer for one position
    max_model_len: int  # the model's context length
    notes: dict = field(default_factory=dict)  # where the numbers came from

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(PromptStepCost(**d["prompt"]), DecodeStepCost(**d["decode"]),
                   HandoffCost(**d["handoff"]), int(d["kv_bytes_per_token"]),
                   int(d["max_model_len"]), dict(d.get("notes", {})))

    @classmethod
    def load(cls, path: str | Path | None = None) -> CostModel:
        """A model saved by ``save`` (None: the built-in one)."""
        return cls.from_dict(json.loads(Path(path or BUILTIN_PATH).read_text()))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path


def fit_prompt(samples: list[tuple[list[tuple[int, int]], float]]) -> PromptStepCost:
    """Prompt steps as (rows as (q, c), seconds) -> the chunk sizer's fit."""
    coef = _fit_non_negative([(ChunkSizer.features(rows), s) for rows, s in samples])
    if coef is None:
        raise ValueError(f"cannot fit a prompt-step model to {len(samples)} samples")
    return PromptStepCost(*coef)


def fit_decode(samples: list[tuple[int, int, float]]) -> DecodeStepCost:
    """Decode steps as (rows, context tokens, seconds). The same non-negative fit; its
    fourth feature is unused (zero)."""
    coef = _fit_non_negative([((1.0, float(r), float(c), 0.0), s) for r, c, s in samples])
    if coef is None:
        raise ValueError(f"cannot fit a decode-step model to {len(samples)} samples")
    return DecodeStepCost(coef[0], coef[1], coef[2])


def fit_handoff(samples: list[tuple[int, float]]) -> HandoffCost:
    """Hand-offs as (bytes, seconds)."""
    coef = _fit_non_negative([((1.0, float(n), 0.0, 0.0), s) for n, s in samples])
    if coef is None:
        raise ValueError(f"cannot fit a hand-off model to {len(samples)} samples")
    return HandoffCost(coef[0], coef[1])
