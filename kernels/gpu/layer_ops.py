"""A decoder layer's small ops as one Triton kernel each: RMSNorm with the residual add,
rotary embedding in place, SiLU times the up-projection, and the KV cache write.

Each computes what its torch reference computes (``kernels/norms.py``,
``kernels/rope.py``, ``engine/model/llama.py``'s MLP, ``kernels/attention.write_blocks_kv``),
in fp32 registers with one rounding to the tensor's dtype where the reference rounds
each op (bf16: at most a unit in the last place apart; tests hold each to its
reference). One launch instead of the reference's 4-8: a decode step at batch 1 is
launch-bound, not bandwidth-bound, outside its matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, x_stride, res_stride, out_stride, eps,
              BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n_cols
    x = tl.load(x_ptr + row * x_stride + c, mask=ok, other=0.0)
    if ADD:  # the sum is rounded to the stream's dtype, stored, and normalised as stored
        x = (x.to(tl.float32) + tl.load(res_ptr + row * res_stride + c, mask=ok,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * res_stride + c, x, mask=ok)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    w = tl.load(w_ptr + c, mask=ok, other=0.0)
    y = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + c, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """``rms_norm(x)``, or with ``residual``: ``residual += x`` (in place) and
    ``rms_norm(residual)``. x, residual: [T, n] (rows contiguous)."""
    t, n = x.shape
    out = torch.empty_like(x)
    add = residual is not None
    res = residual if add else x
    _rms_norm[(t,)](x, res, weight, out, n, x.stride(0), res.stride(0), out.stride(0), eps,
                    BLOCK=triton.next_power_of_2(n), ADD=add)
    return out


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, pos_ptr, x_stride_t, x_stride_h, table_stride, num_heads,
          HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS)
    c = tl.arange(0, HALF_PAD)
    c_ok = c < HALF
    ok = (h < num_heads)[:, None] & c_ok[None, :]
    lo = x_ptr + t * x_stride_t + h[:, None] * x_stride_h + c[None, :]
    x1 = tl.load(lo, mask=ok, other=0.0)
    x2 = tl.load(lo + HALF, mask=ok, other=0.0)
    row = p * table_stride + c
    # the tables are [positions, 2 * HALF]: cos repeated, sin with its first half negated
    c1 = tl.load(cos_ptr + row, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + row + HALF, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + row, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + row + HALF, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(lo, (a * c1 + b * s1).to(x1.dtype), mask=ok)
    tl.store(lo + HALF, (b * c2 + a * s2).to(x1.dtype), mask=ok)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] (a view whose heads are D apart) in place at
    ``positions`` [T]; ``cos``, ``sin_signed`` [N, D] tables (``RopeTable.tables``)
    covering every position."""
    t, heads, d = x.shape
    _rope[(t,)](x, cos, sin_signed, positions, x.stride(0), x.stride(1), cos.stride(0), heads,
                HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2),
                HEADS=triton.next_power_of_2(heads))
    return x


@triton.jit
def _silu_mul(gu_ptr, out_ptr, inter, gu_stride, out_stride, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inter
    g = tl.load(gu_ptr + t * gu_stride + c, mask=ok, other=0.0)
    u = tl.load(gu_ptr + t * gu_stride + inter + c, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # rounded, as F.silu
    tl.store(out_ptr + t * out_stride + c, (silu * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gu[:, :I]) * gu[:, I:]`` for ``gu`` [T, 2I] -> [T, I]."""
    t, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul[(t, triton.cdiv(inter, block))](gu, out, inter, gu.stride(0), out.stride(0),
                                              BLOCK=block)
    return out


@triton.jit
def _write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, k_stride, v_stride, row,
              BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:  # a chunk's position a ring does not keep
        return
    c = tl.arange(0, BLOCK)
    ok = c < row
    tl.store(kc_ptr + slot * row + c, tl.load(k_ptr + t * k_stride + c, mask=ok), mask=ok)
    tl.store(vc_ptr + slot * row + c, tl.load(v_ptr + t * v_stride + c, mask=ok), mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write rows ``k``, ``v`` [T, Hk, D] (each token's heads contiguous) into flat rows
    ``slots`` [T] of a contiguous cache (pages [N, page, Hk, D] or a ring [N, Hk, D]);
    a slot < 0 is skipped."""
    t, hk, d = k.shape
    row = hk * d
    _write_kv[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), row,
                    BLOCK=triton.next_power_of_2(row))
