"""Paged attention read where the KV lies: one Triton kernel for every row a step holds.

A step's queries are flat ``[T, Hq, D]``, rows back to back (``cu_q``: row ``r``'s
queries are ``cu_q[r] .. cu_q[r + 1] - 1``); row ``r`` holds ``seq_lens[r]`` keys, its
queries sit at the last ``q_len`` positions (spec S36), and its keys are found through
its block table (``[B, nb]``, page ``p // page`` at offset ``p % page``) or, for a
sliding-window layer, in its state slot's ring (row ``slot * R + p % R``, spec S37).
The step's own K/V must already be written (``layer_ops.write_kv``): a ring layer may
do so only when every row's chunk is short enough not to overwrite keys its earlier
queries still see (decode rows always are, ``ring_write_first``).

One program takes one KV head, ``BLOCK_Q`` queries of one row and every query head
that shares the KV head (grouped-query attention: the group's heads ride in the tile's
rows, so each key is read once for the group), and a slice of the row's keys: a
decode row's keys are cut into ``num_splits`` slices attended by separate programs
(a single long row would otherwise keep one program per head busy while the GPU's
other units idle), merged by ``_merge_splits`` through each slice's log-sum-exp.
Masking is positional (``key <= query``, ``query - key < window``), so padding rows
and padding table entries are never read as keys of a real query. fp32 inputs
multiply in IEEE fp32 (no TF32): fp32 runs are compared to transformers. Under Triton's
interpreter (CPU tests) 16-bit inputs are widened first: it multiplies them as integers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.gpu import interpreted

BLOCK_N = 64  # keys per iteration
QUERY_TILE = 64  # rows of a multi-query tile (queries x grouped heads)
NO_WINDOW = 1 << 30


@triton.jit
def _paged_attention(  # noqa: PLR0915 (a kernel reads best top to bottom)
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, lse_ptr,
    tables_ptr, seq_lens_ptr, cu_q_ptr, slots_ptr,
    q_stride_t, q_stride_h, kv_stride_page, kv_stride_pos, kv_stride_h,
    o_stride_t, o_stride_h, table_stride,
    scale_log2, window, ring_len, tiles_per_row, num_splits, num_heads,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RING: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = pid // tiles_per_row
    tile = pid % tiles_per_row
    q0 = tl.load(cu_q_ptr + row)
    q_len = tl.load(cu_q_ptr + row + 1) - q0
    if tile * BLOCK_Q >= q_len:
        return
    first_pos = tl.load(seq_lens_ptr + row) - q_len

    m = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + m // GROUP
    head = kvh * GROUP + m % GROUP
    m_ok = (m // GROUP < BLOCK_Q) & (qi < q_len)
    q_pos = first_pos + qi
    tok = (q0 + qi).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # the keys this tile's queries can see, cut into this program's slice
    kv_end = first_pos + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len)
    kv_begin = tl.maximum(first_pos + tile * BLOCK_Q - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, num_splits), BLOCK_N) * BLOCK_N
    lo = kv_begin + split * per_split
    hi = tl.minimum(lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + n
        k_ok = kpos < hi
        if RING:
            ring_row = tl.load(slots_ptr + row).to(tl.int64) * ring_len + kpos % ring_len
            loc = ring_row * kv_stride_pos
        else:
            page = tl.load(tables_ptr + row * table_stride + kpos // PAGE, mask=k_ok, other=0)
            loc = page.to(tl.int64) * kv_stride_page + (kpos % PAGE) * kv_stride_pos
        offs = loc[:, None] + kvh * kv_stride_h + d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2
        seen = (k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
                & (q_pos[:, None] - kpos[None, :] < window))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    store_mask = m_ok[:, None] & d_ok[None, :]
    if SPLIT:
        seen_any = l_i > 0
        l_ref = tl.where(seen_any, l_i, 1.0)
        part = (tok[:, None] * num_heads + head[:, None]) * num_splits + split
        tl.store(part_ptr + part * HEAD_DIM + d[None, :], acc / l_ref[:, None], mask=store_mask)
        lse = tl.where(seen_any, m_i + tl.log2(l_ref), float("-inf"))
        tl.store(lse_ptr + (tok * num_heads + head) * num_splits + split, lse, mask=m_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0 only in masked rows
        tl.store(out_ptr + tok[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_splits(part_ptr, lse_ptr, out_ptr, o_stride_t, o_stride_h, num_heads, num_splits,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < num_splits
    base = (t * num_heads + h) * num_splits
    lse = tl.load(lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(s_ok, tl.exp2(lse - top), 0.0)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    parts = tl.load(part_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * o_stride_t + h * o_stride_h + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)


def query_tile(group: int, max_q: int) -> tuple[int, int]:
    """(queries per tile, tile rows) for a group of ``group`` query heads per KV head:
    one query per tile for decode rows, up to ``QUERY_TILE`` rows otherwise; ``tl.dot``
    wants at least 16 rows."""
    per_tile = 1 if max_q == 1 else max(1, QUERY_TILE // group)
    return per_tile, max(16, triton.next_power_of_2(group * per_tile))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, cu_q: torch.Tensor, seq_lens: torch.Tensor,
                    max_q: int, scale: float, *, tables: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None, ring_len: int = 0,
                    window: int | None = None, num_splits: int = 1) -> torch.Tensor:
    """Attention of ``q`` [T, Hq, D] into ``out`` [T, Hq, D] (may be a view).

    Paged layer: ``k_cache``/``v_cache`` [num_blocks, page, Hk, D] and ``tables`` [B, nb];
    ring layer: [slots * ring_len, Hk, D] and ``slots`` [B]. ``cu_q`` [B + 1] and
    ``seq_lens`` [B] are int32 on the device; ``max_q`` (the longest row's queries, a
    host int) sizes the grid. ``num_splits`` > 1 cuts each row's keys into slices
    (decode rows; a graph fixes it per batch size)."""
    t, hq, dim = q.shape
    ring = tables is None
    hk = k_cache.shape[-2]
    group = hq // hk
    rows = seq_lens.shape[0]
    per_tile, block_m = query_tile(group, max_q)
    tiles = triton.cdiv(max_q, per_tile)
    if ring:
        page, stride_page, stride_pos = 1, 0, k_cache.stride(0)
        tables = slots  # unread; any int tensor
    else:
        page, stride_page, stride_pos = k_cache.shape[1], k_cache.stride(0), k_cache.stride(1)
    split = num_splits > 1
    part = lse = out
    if split:
        part = torch.empty(t, hq, num_splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(t, hq, num_splits, dtype=torch.float32, device=q.device)
    d_pad = triton.next_power_of_2(dim)
    # Triton's interpreter multiplies 16-bit floats as integers: widen them there
    upcast = interpreted() and q.dtype != torch.float32
    _paged_attention[(rows * tiles, hk, num_splits)](
        q, k_cache, v_cache, out, part, lse,
        tables, seq_lens, cu_q, slots if ring else seq_lens,
        q.stride(0), q.stride(1), stride_page, stride_pos, k_cache.stride(-2),
        out.stride(0), out.stride(1), tables.stride(0),
        scale * 1.4426950408889634, window or NO_WINDOW, ring_len, tiles, num_splits, hq,
        HEAD_DIM=dim, D_PAD=d_pad, PAGE=page, GROUP=group, BLOCK_Q=per_tile,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, RING=ring, SPLIT=split, IEEE=q.dtype == torch.float32,
        UPCAST=upcast,
    )
    if split:
        _merge_splits[(t, hq)](part, lse, out, out.stride(0), out.stride(1), hq, num_splits,
                               HEAD_DIM=dim, D_PAD=d_pad,
                               S_PAD=triton.next_power_of_2(num_splits))
    return out


def decode_splits(rows: int, kv_heads: int, units: int, max_splits: int = 16) -> int:
    """Key slices per decode row so that about two programs run per compute unit."""
    return max(1, min(max_splits, triton.cdiv(2 * units, rows * kv_heads)))
