"""A GPU step's inputs: built on the host in one pinned int32 buffer, copied once.

Fields, in this order (``Layout``): per token ``tokens``, ``positions``, ``slots`` (the
flat page slot a full-attention layer writes, -1: none), ``ring_slots`` (the ring row a
sliding-window layer writes, -1: none; used when rows may write before they read,
``ring_write_first``); per row ``cu_q`` (one more), ``seq_lens``, ``state_slots``,
``last`` (the row's last token); then the block tables, ``[rows, width]``.

A decode graph keeps one such buffer on the device at its largest size and replays
with a prefix of it; its padding rows (beyond the step's rows) hold one key at
position 0, write nothing (slot -1) and are sliced off the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TOKEN_FIELDS = ("tokens", "positions", "slots", "ring_slots")
ROW_FIELDS = ("cu_q", "seq_lens", "state_slots", "last")


@dataclass(frozen=True)
class Layout:
    rows: int  # capacity
    tokens: int
    width: int  # block table columns

    def offsets(self) -> dict[str, tuple[int, int]]:
        out, at = {}, 0
        for name in TOKEN_FIELDS:
            out[name] = (at, self.tokens)
            at += self.tokens
        for name in ROW_FIELDS:
            n = self.rows + 1 if name == "cu_q" else self.rows
            out[name] = (at, n)
            at += n
        out["tables"] = (at, self.rows * self.width)
        return out

    def size(self) -> int:
        return sum(n for _, n in self.offsets().values())

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field as a view of ``buffer`` (host or device)."""
        out = {name: buffer[a:a + n] for name, (a, n) in self.offsets().items()}
        out["tables"] = out["tables"].view(self.rows, self.width)
        return out


@dataclass
class GpuMetadata:
    """What every layer of a GPU step reads (device tensors, int32) and the host-side
    bounds that size its kernels' grids."""

    positions: torch.Tensor
    slots: torch.Tensor
    ring_slots: torch.Tensor
    cu_q: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    tables: torch.Tensor
    max_q: int  # the longest row's queries
    splits: int  # key slices per row (decode rows)
    max_position: int
    num_tokens: int
    ring_write_first: bool  # ring layers write the step's K/V, then attend
    reference: object | None = None  # ring layers' torch metadata when not write-first


def fill(views: dict[str, torch.Tensor], rows, cache, padded_rows: int | None = None) -> None:
    """Write ``rows`` (``RunnerRow``s) into host ``views`` (``Layout.views`` of a host
    buffer; ``tables`` at least as wide as the longest row's table). ``padded_rows``: a
    graph's size, the rows beyond the step's filled as padding."""
    v = {k: t.numpy() for k, t in views.items()}
    bs, ring_len = cache.block_size, cache.ring_len
    full, ring = bool(cache.full_layers), bool(cache.ring_layers)
    tables = v["tables"]
    at = 0
    v["cu_q"][0] = 0
    for r, row in enumerate(rows):
        q = len(row.token_ids)
        pos = np.arange(row.start_pos, row.start_pos + q)
        sl = slice(at, at + q)
        v["tokens"][sl] = row.token_ids
        v["positions"][sl] = pos
        if full:
            n = -(-(row.start_pos + q) // bs)
            table = np.asarray(row.block_table[:n])
            tables[r, :n] = table
            v["slots"][sl] = table[pos // bs] * bs + pos % bs
        else:
            v["slots"][sl] = -1
        v["ring_slots"][sl] = row.state_slot * ring_len + pos % ring_len if ring else -1
        v["state_slots"][r] = max(row.state_slot, 0)
        at += q
        v["cu_q"][r + 1] = at
        v["seq_lens"][r] = row.start_pos + q
        v["last"][r] = at - 1
    for r in range(len(rows), padded_rows or 0):  # one query each, at position 0
        for name in ("tokens", "positions"):
            v[name][at] = 0
        v["slots"][at] = v["ring_slots"][at] = -1
        at += 1
        v["cu_q"][r + 1] = at
        v["seq_lens"][r] = 1
        v["state_slots"][r] = 0
        v["last"][r] = at - 1
        tables[r, 0] = 0


def table_width(rows, block_size: int) -> int:
    """Block-table columns a step's rows need (at least 1: a graph's padding rows)."""
    return max([-(-(r.start_pos + len(r.token_ids)) // block_size) for r in rows] + [1])


def host_buffer(n: int, device: torch.device) -> torch.Tensor:
    """An int32 host buffer, pinned where it feeds a GPU (a non-blocking copy then)."""
    return torch.empty(n, dtype=torch.int32, pin_memory=device.type == "cuda")
