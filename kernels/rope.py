"""Rotary position embeddings, computed exactly as transformers does (fp32 angles).

Supports the ``default``, ``linear`` and ``llama3`` frequency schedules. The
rotation is the "rotate half" convention used by Llama-family HF checkpoints.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32 (transformers' formulas)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim)
    )
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    old_len = original_max_position_embeddings
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] for integer positions [T]."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device, torch.float)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTable:
    """cos/sin rows per position, computed once (exactly as ``rope_cos_sin``) and looked
    up by position each step: two index_selects instead of ~8 small ops per step.
    The table grows by doubling when a step reaches a position beyond it."""

    def __init__(self, inv_freq: torch.Tensor, initial: int = 4096):
        self.inv_freq = inv_freq
        self._cache: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._len = 0
        self._initial = initial

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_position: int | None = None,
                signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for positions [T]. ``max_position`` (an upper bound of
        ``positions``, known on the host) avoids a device sync to check the table.
        ``signed``: sin with its first half negated, for ``apply_rope_signed``."""
        top = int(positions.max()) if max_position is None else max_position
        cos, sin, sin_signed = self._rows(dtype, top)
        return cos.index_select(0, positions), (sin_signed if signed else sin).index_select(
            0, positions)

    def tables(self, dtype: torch.dtype, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and signed sin tables [N, head_dim], N > ``max_position``: what a
        kernel that looks positions up itself reads (``kernels/gpu/layer_ops.rope_``)."""
        cos, _, sin_signed = self._rows(dtype, max_position)
        return cos, sin_signed

    def _rows(self, dtype: torch.dtype, top: int):
        if top >= self._len or dtype not in self._cache:
            n = max(self._initial, self._len)
            while n <= top:
                n *= 2
            pos = torch.arange(n, device=self.inv_freq.device)
            cos, sin = rope_cos_sin(pos, self.inv_freq, dtype)
            half = sin.shape[-1] // 2
            sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._cache = {dtype: (cos, sin, sin_signed)}
            self._len = n
        return self._cache[dtype]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (the reference form)."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` with the sign of ``rotate_half`` moved into the table
    (``sin_signed = cat(-sin_lo, sin_hi)``; ``(-a) * b == a * (-b)`` exactly, so the
    result is bitwise the same): swap the halves, multiply, add; two new tensors
    instead of five and no negation pass (prefill moves ~10 MB per layer here)."""
    half = x.shape[-1] // 2
    out = x * cos[:, None, :]
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return out.add_(swapped.mul_(sin_signed[:, None, :]))
