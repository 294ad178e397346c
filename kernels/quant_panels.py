"""Quantized weights for the C matmuls: int8 values dequantized in registers.

    rows = QuantRows(values, scales, offsets, block_k)   # [N, K] int8, [N, K / bk] fp32
    panels = QuantPanels.pack(rows)                      # once at load
    out = matmul(x, panels, bias=None)                   # x [M, K] -> [M, N]

A weight is ``w = scale * q + offset`` per row and block of ``block_k`` consecutive k:
what a GGUF file's Q8_0 (offset 0), Q4_0 (q - 8, offset 0) and Q4_1 (q in 0..15, offset
its block's min) blocks hold (``engine/gguf_file.py`` reads them without dequantizing).
``QuantPanels`` lays the values out as ``skinny_gemm``'s column panels: [P, K, 16] int8
(a quarter of fp32's bytes), or, where every value lies in 0..15 (Q4_0 with offset
``-8 * scale``, Q4_1), [P, K / 2, 16] nibble pairs (an eighth; byte j of pair row i holds
column j of panel row 2i low and of panel row 2i + 1 high: one load, two rows); the scales and offsets per panel column and block [P, K / bk, 16]
fp32. ``skinny_block.h``'s ``matmul_pairs_q8`` converts each panel row to fp32 in
registers (``q * scale + offset``, one FMA shared by every row of x) and multiplies as
the fp32 kernel does. The values are the file's, so the weight is the one
its dequantized copy holds; only the products' rounding differs (the FMA rounds
``scale * q + offset`` once where numpy's dequantization rounds twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import cbuild, skinny_gemm

PANEL = skinny_gemm.PANEL


@dataclass(frozen=True)
class QuantRows:
    """A quantized weight row by row: ``values`` [N, K] int8, ``scales`` and ``offsets``
    (None: all zero) [N, K / block_k] fp32."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    block_k: int

    def __post_init__(self) -> None:
        n, k = self.values.shape
        if self.values.dtype != torch.int8 or k % self.block_k:
            raise ValueError(f"values must be int8 [N, K] with K a multiple of block_k "
                             f"{self.block_k}, got {self.values.dtype} {tuple(self.values.shape)}")
        want = (n, k // self.block_k)
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t is not None and (tuple(t.shape) != want or t.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 {want}, got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [N, K] (numpy's order: scale * q, then + offset)."""
        w = self.values.float().view(self.shape[0], -1, self.block_k) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(self.shape)

    @staticmethod
    def cat(parts: list[QuantRows]) -> QuantRows:
        """Rows of several weights, one after another (a fused q|k|v or gate|up)."""
        if len({p.block_k for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("only weights with one K and one block_k are fused")
        if all(p.offsets is None for p in parts):
            offsets = None
        else:
            offsets = torch.cat([p.offsets if p.offsets is not None
                                 else torch.zeros_like(p.scales) for p in parts])
        return QuantRows(torch.cat([p.values for p in parts]),
                         torch.cat([p.scales for p in parts]), offsets, parts[0].block_k)


def _panels(t: torch.Tensor, p: int) -> torch.Tensor:
    """[N, C] -> [P, C, 16]: rows padded with zeros to P * 16, then as column panels."""
    padded = t.new_zeros(p * PANEL, t.shape[1])
    padded[: t.shape[0]] = t
    return padded.view(p, PANEL, t.shape[1]).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class QuantPanels:
    """``QuantRows`` in the C kernels' layout (see the module docstring)."""

    values: torch.Tensor  # int8 [P, K, 16], or uint8 [P, K / 2, 16] nibble pairs (bits 4)
    scales: torch.Tensor  # fp32 [P, K / block_k, 16]
    offsets: torch.Tensor | None
    block_k: int
    out_features: int
    bits: int = 8

    @classmethod
    def pack(cls, rows: QuantRows, nibbles: bool = True) -> QuantPanels:
        """``nibbles``: values that all lie in 0..15 are kept 4 bits each."""
        n = rows.shape[0]
        p = -(-n // (2 * PANEL)) * 2  # even: threads take pairs of panels
        offsets = None if rows.offsets is None else _panels(rows.offsets, p)
        values, bits = _panels(rows.values, p), 8
        if nibbles and rows.values.numel() and int(rows.values.min()) >= 0 \
                and int(rows.values.max()) <= 15:
            pairs = values.view(p, -1, 2, PANEL)  # panel rows k (even) and k + 1
            values, bits = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).view(torch.uint8).contiguous(), 4
        return cls(values, _panels(rows.scales, p), offsets, rows.block_k, n, bits)

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.block_k

    def nbytes(self) -> int:
        """Bytes one multiplication reads."""
        return sum(t.numel() * t.element_size()
                   for t in (self.values, self.scales, self.offsets) if t is not None)


def available(isa: str | None = None) -> bool:
    return skinny_gemm.available(isa)


def matmul(x: torch.Tensor, w: QuantPanels, bias: torch.Tensor | None = None,
           isa: str | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x [M, K] fp32 on the CPU, W given as ``QuantPanels``."""
    lib = skinny_gemm._library(isa)  # skinny_gemm_q8 lives beside skinny_gemm
    if lib is None:
        raise RuntimeError(f"skinny_gemm ({cbuild.resolve_isa(isa)}) is not available here")
    x = x.contiguous()
    m, k = x.shape
    if k != w.in_features or x.dtype != torch.float32:
        raise ValueError(f"x [{m}, {k}] {x.dtype} does not fit quantized panels for K={w.in_features}")
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    if m:
        b = None if bias is None else bias.contiguous()
        rc = lib.skinny_gemm_q8(x.data_ptr(), m, k, w.values.data_ptr(), w.scales.data_ptr(),
                                None if w.offsets is None else w.offsets.data_ptr(), w.block_k,
                                w.bits, w.out_features, None if b is None else b.data_ptr(),
                                out.data_ptr())
        if rc != 0:
            raise MemoryError("skinny_gemm_q8 could not allocate its scratch rows")
    return out
