"""Attention over the paged cache for one step of mixed rows, vectorised over the batch.

A step's query tokens are flat ``[T]`` (rows back to back). The runner splits the
rows into *groups* (decode rows, q = 1; fresh prompts starting at position 0;
continued prefill chunks) and pads each group to ``[B, Qmax]`` with index tensors;
there is no Python loop over sequences or positions here, only over the (at most
three) groups. Fresh prompts attend to their own K/V only (causal, no cache read).

Full-attention layer: write the step's K/V rows into their slots first, then each
row gathers its block table's blocks ``[B, nb * block_size]`` and attends with a
mask ``key_pos <= query_pos`` (which also hides padding: every key position beyond
``seqlen_k - 1`` is beyond every real query position).

Sliding-window layer (window ``W``, ring of ``R >= W`` rows per state slot): each
row reads its ring (the positions before the chunk: ring row ``i`` holds the
largest ``p < start_pos`` with ``p % R == i``) *before* the chunk is written, and
concatenates the chunk's own K/V; the mask keeps ``0 <= key_pos``,
``key_pos <= query_pos`` and ``query_pos - key_pos < W``. Then the chunk's rows are
written to the ring per S37 (only the last ``R`` of a longer chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.decode_kv import DecodeKV, DecodePlan


@dataclass
class AttentionGroup:
    """Rows of one step padded to a common query length ``Qmax``."""

    token_index: torch.Tensor  # [B, Qmax] long: flat token of each query (padding -> row's first)
    q_valid: torch.Tensor  # [B, Qmax] bool
    q_pos: torch.Tensor  # [B, Qmax] long: absolute positions
    block_tables: torch.Tensor | None  # [B, nb] long, blocks covering seqlen_k (0-padded)
    ring_rows: torch.Tensor | None  # [B, R] long: flat ring rows of the row's state slot
    ring_pos: torch.Tensor | None  # [B, R] long: position held by each ring row (< 0: none)
    valid_tokens: torch.Tensor  # [n_valid] long: token_index[q_valid]
    valid_flat: torch.Tensor | None = None  # [n_valid] long: q_valid.flatten().nonzero();
    # None when every query is valid (e.g. decode rows)
    fresh: bool = False  # every row starts at position 0: keys are the step's own K/V
    decode: bool = False  # every row has one query (q = 1)
    covers_all: bool = False  # the step's only group, its tokens 0 .. T-1 in order
    state_slots: torch.Tensor | None = None  # [B] long, for the C decode step's rings


@dataclass
class AttentionMetadata:
    groups: list[AttentionGroup]
    slot_mapping: torch.Tensor | None  # [T] flat block slot per token (full layers)
    ring_dest: torch.Tensor | None  # [T'] ring rows to write (dropped positions removed)
    ring_src: torch.Tensor | None  # [T'] flat token written to each ring_dest
    num_tokens: int
    max_position: int | None = None  # largest position in the step (host-side bound)
    decode_kv: DecodeKV | None = None  # contiguous K/V of decode rows (full layers) ...
    decode_plan: DecodePlan | None = None  # ... and this step's slots; None: gather


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
          scale: float) -> torch.Tensor:
    """q [B, Qm, Hq, D], k/v [B, Lk, Hk, D], mask [B, Qm, Lk] -> [B, Qm, Hq, D]."""
    # A padded query row with no visible key would give NaN: let it see key 0.
    # (``mask`` is always a fresh tensor here; no host sync on GPUs.)
    mask[..., 0] |= ~mask.any(-1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a 2-D long index over dim 0, via index_select (much faster on CPU
    than advanced indexing): [B, N] -> [B, N, *x.shape[1:]]."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def _valid(out: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    flat = out.reshape(-1, *out.shape[2:])
    return flat if group.valid_flat is None else flat.index_select(0, group.valid_flat)


def as_held(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` holds it (rounded there and back; ``x`` itself when
    the dtypes agree): every path attends to the keys and values the cache holds, so a
    16-bit cache gives the same results whether a key was just computed or read back."""
    return x if x.dtype == dtype else x.to(dtype).to(x.dtype)


def write_blocks_kv(k_blocks: torch.Tensor, v_blocks: torch.Tensor, slots: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
    """Write K/V rows [T, Hk, D] into flat slots [T] of [num_blocks, bs, Hk, D] caches."""
    nb, bs = k_blocks.shape[:2]
    k_blocks.view(nb * bs, *k_blocks.shape[2:]).index_copy_(0, slots, k.to(k_blocks.dtype))
    v_blocks.view(nb * bs, *v_blocks.shape[2:]).index_copy_(0, slots, v.to(v_blocks.dtype))


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                    group: AttentionGroup, scale: float) -> torch.Tensor:
    """Causal attention of a group's queries over their block tables (K/V already written).

    q: flat [T, Hq, D]. Returns [n_valid, Hq, D] for ``group.valid_tokens``.
    """
    bt = group.block_tables
    b, nb = bt.shape
    bs = k_blocks.shape[1]
    k = take(k_blocks, bt).view(b, nb * bs, *k_blocks.shape[2:]).to(q.dtype)
    v = take(v_blocks, bt).view(b, nb * bs, *v_blocks.shape[2:]).to(q.dtype)
    key_pos = torch.arange(nb * bs, device=q.device)
    mask = key_pos[None, None, :] <= group.q_pos[:, :, None]
    out = _sdpa(take(q, group.token_index), k, v, mask, scale)
    return _valid(out, group)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ring: torch.Tensor,
                   v_ring: torch.Tensor, group: AttentionGroup, window: int,
                   scale: float) -> torch.Tensor:
    """Sliding-window attention: ring (positions before the chunk) + the chunk itself.

    q: flat [T, Hq, D]; k/v: flat [T, Hk, D] of this step (not yet in the ring).
    Returns [n_valid, Hq, D] for ``group.valid_tokens``.
    """
    keys = torch.cat([take(k_ring, group.ring_rows).to(k.dtype), take(k, group.token_index)],
                     dim=1)
    vals = torch.cat([take(v_ring, group.ring_rows).to(v.dtype), take(v, group.token_index)],
                     dim=1)
    key_pos = torch.cat([group.ring_pos, group.q_pos], dim=1)  # [B, R + Qmax]
    key_ok = torch.cat([group.ring_pos >= 0, group.q_valid], dim=1)
    qp = group.q_pos[:, :, None]
    kp = key_pos[:, None, :]
    mask = key_ok[:, None, :] & (kp <= qp) & (qp - kp < window)
    out = _sdpa(take(q, group.token_index), keys, vals, mask, scale)
    return _valid(out, group)


def fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup,
                    window: int | None, scale: float) -> torch.Tensor:
    """Rows that all start at position 0 see only their own chunk: plain causal
    attention on the step's K/V (no cache read), ``is_causal`` unless a window bites.

    Query ``i`` of a row sees keys ``j <= i``; padding sits after every real position,
    so only padded queries can see padded keys."""
    qg, kg, vg = take(q, group.token_index), take(k, group.token_index), take(v, group.token_index)
    qm = qg.shape[1]
    if window is not None and qm > window:
        i = torch.arange(qm, device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
        out = _sdpa(qg, kg, vg, mask.expand(qg.shape[0], qm, qm).clone(), scale)
    else:
        out = F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), is_causal=True,
            scale=scale, enable_gqa=qg.shape[2] != kg.shape[2],
        ).transpose(1, 2)
    return _valid(out, group)


def write_ring_kv(k_ring: torch.Tensor, v_ring: torch.Tensor, meta: AttentionMetadata,
                  k: torch.Tensor, v: torch.Tensor) -> None:
    if meta.ring_dest is not None and meta.ring_dest.numel():
        k_ring.index_copy_(0, meta.ring_dest, k.index_select(0, meta.ring_src).to(k_ring.dtype))
        v_ring.index_copy_(0, meta.ring_dest, v.index_select(0, meta.ring_src).to(v_ring.dtype))


def attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One layer's attention for a whole step. q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D]."""
    window = cache.layer_windows[layer]
    k, v = as_held(k, cache.dtype), as_held(v, cache.dtype)
    if window is None:
        k_blocks, v_blocks = cache.k_blocks[layer], cache.v_blocks[layer]
        write_blocks_kv(k_blocks, v_blocks, meta.slot_mapping, k, v)

        def run(g: AttentionGroup) -> torch.Tensor:
            if g.fresh:
                return fresh_attention(q, k, v, g, None, scale)
            if g.decode and meta.decode_plan is not None:
                if g.covers_all:
                    return meta.decode_kv.attention(meta.decode_plan, layer, q, k, v, scale)
                rows = g.valid_tokens
                return meta.decode_kv.attention(meta.decode_plan, layer, q.index_select(0, rows),
                                                k.index_select(0, rows),
                                                v.index_select(0, rows), scale)
            return paged_attention(q, k_blocks, v_blocks, g, scale)
    else:
        k_ring, v_ring = cache.k_ring[layer], cache.v_ring[layer]

        def run(g: AttentionGroup) -> torch.Tensor:
            return (fresh_attention(q, k, v, g, window, scale) if g.fresh
                    else ring_attention(q, k, v, k_ring, v_ring, g, window, scale))

    if len(meta.groups) == 1 and meta.groups[0].covers_all:
        out = run(meta.groups[0])
    else:
        out = torch.empty_like(q)
        for g in meta.groups:  # ring layers: every group reads the ring before the write
            out.index_copy_(0, g.valid_tokens, run(g))
    if window is not None:
        write_ring_kv(k_ring, v_ring, meta, k, v)
    return out
