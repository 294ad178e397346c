"""Where each query position's K/V row goes in the cache (spec S36, S37).

Full attention: position ``p`` of a sequence with block table ``bt`` lives at flat
slot ``bt[p // block_size] * block_size + p % block_size`` of a layer's
``[num_blocks * block_size, kv_heads, head_dim]`` view.

Sliding-window ring: a state slot ``s`` owns ``R`` consecutive ring rows; query ``j``
(0-based) of a chunk of ``q`` positions ending at ``seqlen_k`` goes to
``s * R + (seqlen_k - q + j) % R`` when ``q - j <= R``, else ``-1`` (only the last
``R`` positions of a chunk longer than the ring are kept).

Pure-Python reference versions (``*_list``) sit beside the tensor versions used in
the hot path; tests check that they agree.
"""

from __future__ import annotations

import torch

DEFAULT_RING_LEN = 134


def full_slots_list(block_table: list[int], start_pos: int, q: int, block_size: int) -> list[int]:
    return [
        block_table[p // block_size] * block_size + p % block_size
        for p in range(start_pos, start_pos + q)
    ]


def ring_slots_list(state_slot: int, seqlen_k: int, q: int, ring_len: int) -> list[int]:
    """S37 literally: destinations of queries j = 0 .. q-1."""
    return [
        state_slot * ring_len + (seqlen_k - q + j) % ring_len if q - j <= ring_len else -1
        for j in range(q)
    ]


def full_slots(
    block_tables: torch.Tensor, token_row: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat slot per token. block_tables [B, nb] (long), token_row [T], positions [T]."""
    blocks = block_tables[token_row, positions // block_size]
    return blocks * block_size + positions % block_size


def ring_slots(
    state_slots: torch.Tensor,
    seqlen_k: torch.Tensor,
    q_lens: torch.Tensor,
    token_row: torch.Tensor,
    positions: torch.Tensor,
    ring_len: int,
) -> torch.Tensor:
    """Ring destination per token (``-1`` when dropped). Per-row tensors [B], per-token [T].

    ``j = positions - (seqlen_k - q)``, so ``q - j = seqlen_k - positions``.
    """
    dest = state_slots[token_row] * ring_len + positions % ring_len
    keep = (seqlen_k[token_row] - positions) <= ring_len
    return torch.where(keep, dest, torch.full_like(dest, -1))
