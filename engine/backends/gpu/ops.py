"""The layer's small ops as the fused Triton kernels of ``kernels/gpu/layer_ops``."""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import LayerOps
from pdserve.kernels.gpu import layer_ops


class FusedOps(LayerOps):
    """``cos``, ``sin_signed``: the whole rotary tables, made once at start: a captured
    graph holds their addresses, so they must never be reallocated."""

    def __init__(self, cos: torch.Tensor, sin_signed: torch.Tensor):
        self.cos, self.sin_signed = cos, sin_signed

    def rotation(self, table, positions, dtype, max_position):
        return positions  # the rope kernel looks the tables up itself

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return layer_ops.rope_(x, positions, self.cos, self.sin_signed)

    def norm(self, x, weight, eps, residual=None):
        if residual is None:
            return layer_ops.rms_norm(x, weight, eps), x
        return layer_ops.rms_norm(x, weight, eps, residual=residual), residual

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return layer_ops.silu_mul(gu)
