"""Quantized weights for the C matmuls: int8 values dequantized in registers.

    rows = QuantRows(values, scales, offsets, block_k)   # [N, K] int8, [N, K / bk] fp32
    panels = QuantPanels.pack(rows)                      # once at load
    out = matmul(x, panels, bias=None)                   # x [M, K] -> [M, N]
    rows = gather_columns(panels, ids)                   # W[ids] [n, K]: a tied embedding

A weight is ``w = scale * q + offset`` per row and block of ``block_k`` consecutive k:
what a GGUF file's Q8_0 (offset 0), Q4_0 (q - 8, offset 0) and Q4_1 (q in 0..15, offset
its block's min) blocks hold (``engine/model/gguf_file.py`` reads them without dequantizing).
``QuantPanels`` lays a weight out as one stream of records (``skinny_block.h`` says why):
pair of 16-column panels by pair, block by block, panel by panel, each record 16
scales, 16 offsets (when there are any) and the block's values for the panel's 16
columns: int8 panel rows (16 bytes each), or, where every value lies in 0..15 (Q4_0 with
offset ``-8 * scale``, Q4_1), nibble pairs (byte j of pair row i holds column j of panel
row 2i low and of panel row 2i + 1 high: one load, two rows). A Q4_1 block of 32 x 16
is 320 bytes: 0.625 bytes a weight, llama.cpp's 0.625 too. Scales and offsets are fp16
where they all are fp16 values (Q8_0, Q4_0 and Q4_1's are, and int8 quantization at load
makes its scales so), else fp32 (the K-quants' products of a super-block's scale and a
sub-block's: Q4_K 0.75 bytes a weight, its file 0.5625; Q6_K 1.25, its file 0.82). The
values are the file's, so the weight is the one its dequantized copy holds; only the
products' rounding differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import cbuild, skinny_gemm

PANEL = skinny_gemm.PANEL


@dataclass(frozen=True)
class QuantRows:
    """A quantized weight row by row: ``values`` [N, K] int8 (or bfloat16: the weight's
    bf16 rounding, with unit scales and no offsets, which the kernels skip), ``scales``
    and ``offsets`` (None: all zero) [N, K / block_k] fp32."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    block_k: int

    def __post_init__(self) -> None:
        n, k = self.values.shape
        if self.values.dtype not in (torch.int8, torch.bfloat16) or k % self.block_k:
            raise ValueError(f"values must be int8 or bfloat16 [N, K] with K a multiple of block_k "
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

    def with_block_k(self, block_k: int) -> QuantRows:
        """The same weight with a scale (and offset) per ``block_k``, a divisor of this
        one's: each repeated."""
        if self.block_k % block_k:
            raise ValueError(f"block_k {block_k} does not divide {self.block_k}")
        r = self.block_k // block_k
        return QuantRows(self.values, self.scales.repeat_interleave(r, dim=1),
                         None if self.offsets is None else self.offsets.repeat_interleave(r, dim=1),
                         block_k)

    @staticmethod
    def cat(parts: list[QuantRows]) -> QuantRows:
        """Rows of several weights, one after another (a fused q|k|v or gate|up; a Q4_K
        q beside a Q6_K v gets the finer blocks)."""
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError("only weights with one K are fused")
        finest = min(p.block_k for p in parts)
        parts = [p if p.block_k == finest else p.with_block_k(finest) for p in parts]
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


def _unpanels(t: torch.Tensor, n: int) -> torch.Tensor:
    """``_panels``' inverse: [P, C, 16] -> [n, C]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def _fits_fp16(t: torch.Tensor | None) -> bool:
    if t is None:
        return True
    h = t.to(torch.float16)
    return torch.equal(h.float(), t) and bool(torch.isfinite(h).all())


@dataclass(frozen=True)
class QuantPanels:
    """``QuantRows`` in the C kernels' layout (see the module docstring)."""

    records: torch.Tensor  # uint8 [pairs, K / block_k, 2, record bytes]
    block_k: int
    out_features: int
    bits: int = 8
    has_offsets: bool = False
    scale_bytes: int = 2  # fp16 scales and offsets, or 4: fp32
    dots: bool = False  # the int8-activation layout (multiplied by int8 rows of x)

    @classmethod
    def pack(cls, rows: QuantRows, nibbles: bool = True, dots: bool = False) -> QuantPanels:
        """``nibbles``: values that all lie in 0..15 are kept 4 bits each. ``dots``: laid
        out for int8 activations (``dots_fit`` says which weights can be). Raises
        ValueError when a scale or offset is not finite, or ``dots`` for a weight that
        does not fit it."""
        for t in (rows.scales, rows.offsets):
            if t is not None and not bool(torch.isfinite(t).all()):
                raise ValueError("scales and offsets must be finite")
        if rows.values.dtype == torch.bfloat16 and (
                rows.offsets is not None or not bool((rows.scales == 1).all())):
            raise ValueError("bf16 values are the weight itself: unit scales, no offsets")
        if dots and not dots_fit(rows):
            raise ValueError(f"int8 activations need integer values with block_k 16 or 32, "
                             f"got {rows.values.dtype} block_k {rows.block_k}")
        half = _fits_fp16(rows.scales) and _fits_fp16(rows.offsets)
        dtype = torch.float16 if half else torch.float32
        n, k = rows.shape
        p, nb = -(-n // (2 * PANEL)) * 2, k // rows.block_k  # even: threads take pairs
        values = _panels(rows.values, p)
        bits = 16 if rows.values.dtype == torch.bfloat16 else 8
        if bits == 8 and nibbles and rows.values.numel() and int(rows.values.min()) >= 0 \
                and int(rows.values.max()) <= 15:
            bits = 4
            if dots:  # tiles of 8 k: k + j low, k + 4 + j high, column by column
                halves = values.view(p, -1, 2, 4, PANEL)
                values = (halves[:, :, 0] | (halves[:, :, 1] << 4)).transpose(2, 3)
            else:
                pairs = values.view(p, -1, 2, PANEL)  # panel rows k (even) and k + 1
                values = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
        elif dots:  # tiles of 4 k, column by column
            values = values.view(p, -1, 4, PANEL).transpose(2, 3)
        parts = [_panels(rows.scales, p).to(dtype).view(torch.uint8)]
        if rows.offsets is not None:
            parts.append(_panels(rows.offsets, p).to(dtype).view(torch.uint8))
        parts.append(values.view(torch.uint8).reshape(p, nb, -1))
        records = torch.cat(parts, dim=-1)  # [P, blocks, record]
        records = records.view(p // 2, 2, nb, -1).transpose(1, 2).contiguous()
        return cls(records, rows.block_k, n, bits, rows.offsets is not None, 2 if half else 4,
                   dots)

    @property
    def in_features(self) -> int:
        return self.records.shape[1] * self.block_k

    def unpack(self) -> QuantRows:
        """The rows this was packed from (``pack``'s inverse)."""
        pairs, nb, _, size = self.records.shape
        by_panel = self.records.transpose(1, 2).reshape(2 * pairs, nb, size)
        head = self.scale_bytes * PANEL * (2 if self.has_offsets else 1)
        raw = by_panel[..., head:]
        if self.bits == 16:
            values = raw.contiguous().view(torch.bfloat16).reshape(2 * pairs, -1, PANEL)
        else:
            values = raw.reshape(2 * pairs, -1, PANEL)  # [P, K or K / 2, 16]
            if self.dots:  # tiles [16 columns, 4] back to [4, 16]
                values = values.reshape(2 * pairs, -1, PANEL, 4).transpose(2, 3).reshape(
                    2 * pairs, -1, PANEL)
            if self.bits == 4 and self.dots:
                tiles = values.reshape(2 * pairs, -1, 4, PANEL)
                values = torch.stack([tiles & 15, tiles >> 4], dim=2).reshape(
                    2 * pairs, -1, PANEL)
            elif self.bits == 4:
                values = torch.stack([values & 15, values >> 4], dim=2).reshape(
                    2 * pairs, -1, PANEL)
            values = values.view(torch.int8)
        dtype = torch.float16 if self.scale_bytes == 2 else torch.float32
        heads = by_panel[..., :head].contiguous().view(dtype).float()
        scales = _unpanels(heads[..., :PANEL], self.out_features)
        offsets = _unpanels(heads[..., PANEL:], self.out_features) if self.has_offsets else None
        return QuantRows(_unpanels(values, self.out_features).contiguous(),
                         scales.contiguous(), None if offsets is None else offsets.contiguous(),
                         self.block_k)

    def nbytes(self) -> int:
        """Bytes one multiplication reads."""
        return self.records.numel()


def dots_fit(rows: QuantRows) -> bool:
    """Can ``rows`` be packed for int8 activations: integer values (not bf16), blocks
    of 16 or 32 (x's steps and units, dot_block.h's tile_k and X_UNIT, meet a block
    whole, and its 32-bit sums stay in range)."""
    return rows.values.dtype == torch.int8 and rows.block_k in (16, 32)


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
        kernel = lib.skinny_gemm_dots if w.dots else lib.skinny_gemm_q8
        rc = kernel(x.data_ptr(), m, k, w.records.data_ptr(), w.block_k, w.bits,
                                int(w.has_offsets), w.scale_bytes, w.out_features,
                                None if b is None else b.data_ptr(), out.data_ptr())
        if rc != 0:
            raise MemoryError("the quantized matmul could not allocate its scratch rows")
    return out


def gather_columns(w: QuantPanels, ids: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """Rows ``ids`` of the weight, dequantized: [n, K] fp32, each equal bit for bit to
    that row of ``w.unpack().dequantize()``. A tied model's embedding lookup reads its LM
    head's records this way, so the rank keeps no fp32 copy of the matrix. IndexError
    for an id outside [0, N)."""
    lib = skinny_gemm._library(isa)
    if lib is None:
        raise RuntimeError(f"skinny_gemm ({cbuild.resolve_isa(isa)}) is not available here")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), w.in_features, dtype=torch.float32)
    rc = lib.q_gather_columns(w.records.data_ptr(), w.block_k, w.bits, int(w.has_offsets),
                              w.scale_bytes, int(w.dots), w.in_features, w.out_features, flat.data_ptr(),
                              flat.numel(), out.data_ptr())
    if rc != 0:
        raise IndexError(f"token ids must lie in [0, {w.out_features})")
    return out.view(*ids.shape, w.in_features)
