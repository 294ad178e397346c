"""The device seam: what the model asks of a backend, and the torch reference of it.

A backend is a metadata builder plus a per-layer forward (vLLM v1's split):

- ``prepare(rows)``: once per step, the step's inputs from the runner's rows (flat
  tokens, positions, the attention metadata every layer reads, the index of each row's
  last token), built on the host and moved to the device;
- ``forward(layer, q, k, v, cache, meta, scale)``: one layer's attention over the paged
  cache, the step's K/V written first;
- ``ops``: the layer's small ops (RMSNorm with the residual add, rotary, SiLU times up)
  as the device runs them best;
- ``run(model, rows, want, greedy)``: the step's logits (a decode step may replay a
  graph), and where asked and the step can, each row's argmax of them (``StepLogits``).

The model (``engine/model/llama.py``) calls only these; it holds no device tests. The CPU
backend (``cpu/``) keeps the C decode step, the contiguous decode K/V and the thread
tuner; the GPU backend (``gpu/``) reads pages in place with Triton kernels, fuses the
small ops and replays decode steps from CUDA graphs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import NamedTuple

import torch

from pdserve.kernels.attention import attention_step
from pdserve.kernels.norms import rms_norm
from pdserve.kernels.rope import RopeTable, apply_rope_signed

StepInputs = tuple  # (tokens [T], positions [T], metadata, last token of each row [B])


class LayerOps:
    """The small ops in torch: the reference, and the CPU's path."""

    def rotation(self, table: RopeTable, positions: torch.Tensor, dtype: torch.dtype,
                 max_position: int | None):
        """What ``rope`` reads for this step's positions (computed once per step)."""
        return table.cos_sin(positions, dtype, max_position, signed=True)

    def rope(self, x: torch.Tensor, rotation) -> torch.Tensor:
        """``x`` [T, heads, D] rotated (a new tensor, or ``x`` rotated in place)."""
        return apply_rope_signed(x, *rotation)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(s), s) for s = x + residual (or x): the layer's residual stream.
        ``x`` is a sublayer's fresh output, so the sum may take its storage."""
        s = x if residual is None else x.add_(residual)
        return rms_norm(s, weight, eps), s

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        i = gu.shape[1] // 2
        return torch.nn.functional.silu(gu[:, :i]).mul_(gu[:, i:])  # in place: one fewer [T, I]


class StepLogits(NamedTuple):
    """What a step hands the sampler: fp32 logits [len(want), V] at the last token of
    each row in ``want`` (None when ``want`` is empty), and, when the caller asked
    (``greedy``) and the step could, each row's first largest logit's index [len(want)],
    computed while the logits were in cache (else None: the caller takes it)."""

    values: torch.Tensor | None
    greedy: torch.Tensor | None = None


class AttentionBackend(ABC):
    """See the module docstring."""

    name: str
    ops: LayerOps

    def start(self) -> None:
        """Work done once the model runs through this backend (a GPU captures its
        decode graphs)."""
        return None

    def step_scope(self, rows):
        """The context a whole step (sampling included) runs in."""
        return nullcontext()

    @abstractmethod
    def prepare(self, rows) -> StepInputs: ...

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache,
                meta, scale: float) -> torch.Tensor: ...

    @abstractmethod
    def run(self, model, rows, want: list[int], greedy: bool = False) -> StepLogits:
        """The logits at the last token of each row in ``want`` (every row's K/V written);
        with ``greedy`` (each row's token will be its argmax), that argmax too where the
        step computes it."""


class ReferenceAttention:
    """The torch reference of ``forward`` and ``ops``: what a model runs when no backend
    was chosen (a model loaded on its own, tests handing it ``AttentionMetadata``)."""

    name = "reference"
    ops = LayerOps()

    @staticmethod
    def forward(layer, q, k, v, cache, meta, scale):
        return attention_step(q, k, v, layer, cache, meta, scale)
