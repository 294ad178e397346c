"""Contiguous copies of the decode rows' K/V, so a decode step does not gather blocks.

Why: with a paged cache, every decode step of every full-attention layer gathers each
row's blocks (``index_select``) into a contiguous tensor before attention, i.e. it
reads and writes the whole KV of the batch again, per layer, per step. On CPU that
gather cost more than the attention itself. Hugging Face's DynamicCache pays the
same with a ``torch.cat`` per step. Here each decode row keeps a *slot*: a row of
``k[layer]``/``v[layer]`` shaped ``[slots, kv_heads, capacity, head_dim]`` holding
positions ``0 .. len-1`` of its sequence. A step appends one position per row (the
paged cache is still written too: it stays the source of truth) and attends over
the slots in place. Rows gather their blocks only when they first decode (or after
anything invalidated their slot).

A slot is found by its key ``(block ids covering 0 .. len-1, len)``; a row with
``start_pos == len`` and the same leading block ids continues it. Safety rules:

- Slots that the current step's decode rows do not claim are dropped: a finished
  sequence's blocks can be handed to a new sequence that happens to have the same
  length, and its slot must not be found again. So ``plan`` runs on every step,
  including steps without decode rows.
- ``KVCache.version`` changes on every write that is not a model step (imports,
  block copies for forks): all slots are dropped then.
- Within one step two rows never claim the same slot (forked siblings may share
  every block covering ``0 .. len-1``); the second one gathers into a new slot.

The copy is capped at ``max_bytes``; beyond that the step falls back to gathering
(``plan`` returns None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class DecodePlan:
    """Where a step's decode rows (in group order) live in the contiguous copy."""

    slots: torch.Tensor  # [B] long: slot of each row
    positions: torch.Tensor  # [B] long: the position each row writes (= start_pos)
    num_slots: int  # attention runs over slots [0, num_slots)
    length: int  # keys [0, length): max(start_pos) + 1
    identity: bool  # slots == arange(B): no scatter/gather of queries needed
    mask: torch.Tensor | None  # [num_slots, 1, 1, length] additive (0 / -inf); None: all keys
    fill_slots: torch.Tensor | None  # [F] slots to fill from the paged cache first
    fill_blocks: torch.Tensor | None  # [F, nb] their block ids (0-padded)


class DecodeKV:
    def __init__(self, cache, max_bytes: int, length_step: int = 128):
        self.cache = cache
        self.max_bytes = max_bytes
        self.length_step = length_step
        self.k: list[torch.Tensor | None] = [None] * cache.num_layers
        self.v: list[torch.Tensor | None] = [None] * cache.num_layers
        self.capacity = 0  # positions per slot
        self.keys: dict[tuple, int] = {}  # (block ids, len) -> slot
        self.version = cache.version

    def _bytes(self, slots: int, capacity: int) -> int:
        c = self.cache
        elem = c.compute_dtype.itemsize
        return 2 * len(c.full_layers) * slots * c.num_kv_heads * capacity * c.head_dim * elem

    def _grow(self, slots: int, capacity: int) -> None:
        """Reallocate to at least ``slots`` x ``capacity``, keeping what is stored."""
        old_slots = 0 if self.k[self.cache.full_layers[0]] is None else \
            self.k[self.cache.full_layers[0]].shape[0]
        if slots <= old_slots and capacity <= self.capacity:
            return
        slots, capacity = max(slots, old_slots), max(capacity, self.capacity)
        c = self.cache
        for i in c.full_layers:
            for store in (self.k, self.v):
                # Zeros, not empty: masked keys still meet their values in SDPA
                # (weight 0 * NaN from uninitialised memory would be NaN).
                new = torch.zeros(slots, c.num_kv_heads, capacity, c.head_dim, dtype=c.compute_dtype,
                                  device=c.device)
                if store[i] is not None:
                    new[:old_slots, :, :self.capacity] = store[i]
                store[i] = new
        self.capacity = capacity

    def plan(self, block_tables: list[list[int]], starts: list[int]) -> DecodePlan | None:
        """Assign slots to this step's decode rows (empty lists for a step without
        any); None when the copy would exceed ``max_bytes`` (gather instead)."""
        c = self.cache
        if self.version != c.version:
            self.keys.clear()
            self.version = c.version
        old, self.keys = self.keys, {}
        if not starts or not c.full_layers:
            return None
        bs = c.block_size
        slots, fills = _assign_slots(old, block_tables, starts, bs)
        num_slots = max(slots) + 1
        length = max(starts) + 1
        bs_len = max((math.ceil(starts[n] / bs) * bs for n in fills), default=0)
        capacity = self._capacity_for(max(length, bs_len))
        if self._bytes(num_slots, capacity) > self.max_bytes:
            return None
        self._grow(num_slots, capacity)
        for n, (bt, s) in enumerate(zip(block_tables, starts, strict=True)):
            self.keys[(tuple(bt[:math.ceil((s + 1) / bs)]), s + 1)] = slots[n]

        dev = c.device
        identity = slots == list(range(len(starts)))
        mask = None
        if not identity or any(s != length - 1 for s in starts):
            mask = _key_mask(slots, starts, num_slots, length, c.compute_dtype).to(dev)
        fill_slots, fill_blocks = _fill_sources(block_tables, starts, slots, fills, bs, dev)
        return DecodePlan(
            slots=torch.tensor(slots, device=dev), positions=torch.tensor(starts, device=dev),
            num_slots=num_slots, length=length, identity=identity, mask=mask,
            fill_slots=fill_slots, fill_blocks=fill_blocks)

    def _capacity_for(self, need: int) -> int:
        """Positions per slot for keys [0, need): the current capacity, else grown in
        steps of ``length_step``."""
        if need <= self.capacity:
            return self.capacity
        return math.ceil((need + 1) / self.length_step) * self.length_step

    def attention(self, plan: DecodePlan, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, scale: float) -> torch.Tensor:
        """One full-attention layer for the decode rows. q [B, Hq, D], k/v [B, Hk, D]
        (this step's position of each row; already written to the paged cache).
        Returns [B, Hq, D]."""
        kc, vc = self.k[layer], self.v[layer]
        if plan.fill_slots is not None:
            self._fill(plan, layer, kc, vc)
        kc[plan.slots, :, plan.positions] = k
        vc[plan.slots, :, plan.positions] = v
        return _decode_attention(q, kc, vc, plan, scale)

    def forget(self) -> None:
        """Drop every slot: for a decode step that does not use the copy (the C step
        reads the paged cache), after which no stored slot may be trusted (a finished
        sequence's blocks may come back to a new sequence of the same length)."""
        self.keys.clear()

    def fill_all_layers(self, plan: DecodePlan) -> None:
        """For callers that run every layer's attention themselves (the compiled decode
        step): copy the rows that decode for the first time into their slots."""
        if plan.fill_slots is not None:
            for i in self.cache.full_layers:
                self._fill(plan, i, self.k[i], self.v[i])

    def _fill(self, plan: DecodePlan, layer: int, kc: torch.Tensor, vc: torch.Tensor) -> None:
        """Copy the new rows' blocks [F, nb * bs] into their slots (positions past a row's
        length are padding: masked now, overwritten by later appends)."""
        f, nb = plan.fill_blocks.shape
        idx = plan.fill_blocks.reshape(-1)
        for blocks, dst in ((self.cache.k_blocks[layer], kc), (self.cache.v_blocks[layer], vc)):
            rows = blocks.index_select(0, idx)  # [F * nb, bs, Hk, D]
            rows = rows.view(f, nb * blocks.shape[1], *blocks.shape[2:]).transpose(1, 2)
            dst[plan.fill_slots, :, :nb * blocks.shape[1]] = rows.to(dst.dtype)


def _assign_slots(old: dict[tuple, int], block_tables: list[list[int]], starts: list[int],
                  bs: int) -> tuple[list[int], list[int]]:
    """Each row's slot: the one its key names in ``old`` (popped: no second row takes
    it), else the lowest free one; and the rows that got a new slot (to fill)."""
    slots: list[int] = [-1] * len(starts)
    for n, (bt, s) in enumerate(zip(block_tables, starts, strict=True)):
        slot = old.pop((tuple(bt[:math.ceil(s / bs)]), s), None)
        if slot is not None:
            slots[n] = slot
    used = {s for s in slots if s >= 0}
    free = (i for i in range(len(starts) + len(used)) if i not in used)
    fills = []
    for n, s in enumerate(slots):
        if s < 0:
            slots[n] = next(free)
            fills.append(n)
    return slots, fills


def _key_mask(slots: list[int], starts: list[int], num_slots: int, length: int,
              dtype: torch.dtype) -> torch.Tensor:
    """[num_slots, 1, 1, length] additive mask: each row's slot sees keys [0, start]."""
    lens = torch.ones(num_slots, dtype=torch.long)  # idle slots see key 0 only
    lens[torch.tensor(slots)] = torch.tensor(starts) + 1
    hide = torch.arange(length)[None, :] >= lens[:, None]
    return torch.zeros(num_slots, 1, 1, length, dtype=dtype).masked_fill_(
        hide[:, None, None, :], float("-inf"))


def _fill_sources(block_tables: list[list[int]], starts: list[int], slots: list[int],
                  fills: list[int], bs: int, dev: torch.device
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The slots of the rows in ``fills`` and the block ids (0-padded) to fill them from;
    (None, None) when no row has a position before its start to copy."""
    if not fills:
        return None, None
    nb = max(math.ceil(starts[n] / bs) for n in fills)
    if not nb:
        return None, None
    fill_slots = torch.tensor([slots[n] for n in fills], device=dev)
    fill_blocks = torch.tensor(
        [(block_tables[n][:nb] + [0] * nb)[:nb] for n in fills], device=dev)
    return fill_slots, fill_blocks


def _decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: DecodePlan,
                      scale: float) -> torch.Tensor:
    """Single-query attention over slots [0, n) and keys [0, L) of the copies
    kc/vc [S, Hk, C, D], as two batched matmuls per (slot, kv head).

    Why not SDPA: its flash kernel is built for query blocks; with one query per row
    it took ~25% longer than scores = q @ K^T, softmax, @ V (which also reads K and
    V in place: [S * Hk, C, D] views, no copies). Query head h uses kv head
    h // (Hq / Hk), as transformers' ``repeat_kv``."""
    b, hq, d = q.shape
    n, length, hk = plan.num_slots, plan.length, kc.shape[1]
    g = hq // hk
    if plan.identity:
        qs = q.reshape(n * hk, g, d)
    else:
        qs = q.new_zeros(n, hq, d)
        qs[plan.slots] = q
        qs = qs.view(n * hk, g, d)
    k = kc.view(-1, kc.shape[2], d)[:n * hk, :length]
    v = vc.view(-1, vc.shape[2], d)[:n * hk, :length]
    scores = torch.baddbmm(qs.new_empty(n * hk, g, length), qs, k.transpose(1, 2),
                           beta=0.0, alpha=scale)
    if plan.mask is not None:
        scores.view(n, hk, g, length).add_(plan.mask)
    out = torch.bmm(scores.softmax(dim=-1), v).view(n, hq, d)
    return out if plan.identity else out.index_select(0, plan.slots)
