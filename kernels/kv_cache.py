"""Paged KV cache: blocks for full-attention layers, a ring per state slot for
sliding-window layers.

Layout (per layer ``l``):

- full-attention layer: ``k_blocks[l]``, ``v_blocks[l]`` shaped
  ``[num_blocks, block_size, num_kv_heads, head_dim]``. Block 0 is padding: the
  scheduler never hands it out, block tables are padded with 0, and nothing reads
  a padding entry (masks exclude it).
- sliding-window layer: ``k_ring[l]``, ``v_ring[l]`` shaped
  ``[num_state_slots * ring_len, num_kv_heads, head_dim]``; state slot ``s`` owns
  rows ``s*R .. s*R+R-1`` and position ``p`` lives at row ``s*R + p % R`` (spec S37).
  ``ring_len >= window`` so a chunk always finds the ``window - 1`` positions before
  it. Sliding-window layers have no block storage (their entries are ``None``).

KV hand-off (the lead's export/import builds on these):

- ``export_shapes(num_tokens, first_block=0) -> {name: (dtype, shape)}``:
  ``"k_blocks"``/``"v_blocks"``: ``[num_full_layers, n, block_size, H, D]`` for the
  blocks ``first_block .. ceil(num_tokens / block_size) - 1`` of a block table;
  ``"k_ring"``/``"v_ring"``: ``[num_ring_layers, ring_len, H, D]`` for the slot
  (present only when the model has such layers).
- ``export_into(block_ids, state_slot, num_tokens, out, first_block=0)``: gathers
  those tensors straight into ``out`` (CPU tensors of those shapes, e.g. views of a
  payload's buffer: one copy); ``export_sequence(...)`` returns fresh tensors.
- ``import_sequence(block_ids, state_slot, tensors)``: writes such a dict into
  this cache's ``block_ids`` (``len >= n``) and ``state_slot``; shapes are checked
  and errors name the tensor and the expected/actual shape.
- ``check_import(tensors, num_tokens)``: the same checks without writing (call it
  before allocating blocks for the payload).
- ``layout()``: plain dict for a payload header (block size, heads, dims, dtype,
  which layers are full / ring, ring length); two caches can exchange payloads when
  their layouts are equal.
- Lower level: ``read_blocks(block_ids)``, ``write_blocks(block_ids, k, v)``,
  ``read_ring(state_slot)``, ``write_ring(state_slot, k, v)``, and for forks
  ``copy_block(src, dst)`` and ``copy_state(src_slot, dst_slot)``.
"""

from __future__ import annotations

import array
import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kernels import cbuild
from pdserve.kernels.slot_mapping import DEFAULT_RING_LEN


def default_ring_len(window: int | None) -> int:
    return max(DEFAULT_RING_LEN, int(window or 0))


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        layer_windows: tuple[int | None, ...] | None = None,
        num_state_slots: int = 0,
        ring_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        copy_threads: int = 1,
        compute_dtype: torch.dtype | None = None,
    ):
        windows = tuple(layer_windows) if layer_windows is not None else (None,) * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"layer_windows has {len(windows)} entries, expected {num_layers}")
        max_window = max((w for w in windows if w is not None), default=None)
        if ring_len is None:
            ring_len = default_ring_len(max_window)
        if max_window is not None and ring_len < max_window:
            raise ValueError(f"ring_len {ring_len} is shorter than the sliding window {max_window}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is padding), got {num_blocks}")
        if max_window is not None and num_state_slots < 1:
            raise ValueError("a sliding-window model needs num_state_slots >= 1")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layer_windows = windows
        self.num_state_slots = num_state_slots
        # Bumped by every write that does not come from a model step (imports, block
        # and state copies): copies of cache contents (``DecodeKV``) check it.
        self.version = 0
        self.ring_len = ring_len
        self.dtype = dtype
        # what attention computes in: the model's dtype (fp32 over a 16-bit cache on CPU)
        self.compute_dtype = compute_dtype or dtype
        self.device = torch.device(device)
        self.full_layers = [i for i, w in enumerate(windows) if w is None]
        self.ring_layers = [i for i, w in enumerate(windows) if w is not None]

        def blocks():
            return torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                               device=self.device)

        def ring():
            return torch.zeros(num_state_slots * ring_len, num_kv_heads, head_dim, dtype=dtype,
                               device=self.device)

        self.k_blocks = [blocks() if w is None else None for w in windows]
        self.v_blocks = [blocks() if w is None else None for w in windows]
        self.k_ring = [ring() if w is not None else None for w in windows]
        self.v_ring = [ring() if w is not None else None for w in windows]
        self._kernel_pools: dict = {}  # block copies' view of the pools (_kernel_pools)
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        # threads of the C block copies (imports, exports), see kv_copy.c
        self.copy_threads = copy_threads

    # ---- description -------------------------------------------------------
    def layout(self) -> dict:
        return {
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "full_layers": list(self.full_layers),
            "ring_layers": list(self.ring_layers),
            "ring_len": self.ring_len if self.ring_layers else 0,
        }

    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * len(self.full_layers) * self.block_size * self.num_kv_heads * self.head_dim * elem

    def ring_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return (2 * len(self.ring_layers) * self.num_state_slots * self.ring_len
                * self.num_kv_heads * self.head_dim * elem)

    # ---- blocks ------------------------------------------------------------
    def _ids(self, ids) -> torch.Tensor:
        return torch.as_tensor(list(ids), dtype=torch.long, device=self.device)

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the full-attention layers: [num_full_layers, n, bs, H, D] each."""
        idx = self._ids(block_ids)
        if not self.full_layers:
            empty = torch.empty(0, len(block_ids), self.block_size, self.num_kv_heads,
                                self.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty.clone()
        k = torch.stack([self.k_blocks[i].index_select(0, idx) for i in self.full_layers])
        v = torch.stack([self.v_blocks[i].index_select(0, idx) for i in self.full_layers])
        return k, v

    def write_blocks(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        shape = (len(self.full_layers), len(block_ids), self.block_size, self.num_kv_heads,
                 self.head_dim)
        _check("k_blocks", k, shape)
        _check("v_blocks", v, shape)
        self.version += 1
        if self.full_layers:
            pools = self._kernel_pools
            threads = self.copy_threads
            _scatter_into(pools, [self.k_blocks[i] for i in self.full_layers], block_ids, k,
                          threads)
            _scatter_into(pools, [self.v_blocks[i] for i in self.full_layers], block_ids, v,
                          threads)

    def copy_block(self, src: int, dst: int) -> None:
        self.version += 1
        for i in self.full_layers:
            self.k_blocks[i][dst].copy_(self.k_blocks[i][src])
            self.v_blocks[i][dst].copy_(self.v_blocks[i][src])

    # ---- ring --------------------------------------------------------------
    def _ring_rows(self, state_slot: int) -> slice:
        if not 0 <= state_slot < self.num_state_slots:
            raise IndexError(f"state slot {state_slot} out of range [0, {self.num_state_slots})")
        return slice(state_slot * self.ring_len, (state_slot + 1) * self.ring_len)

    def read_ring(self, state_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rings of the sliding-window layers: [num_ring_layers, R, H, D] each."""
        if not self.ring_layers:
            empty = torch.empty(0, self.ring_len, self.num_kv_heads, self.head_dim,
                                dtype=self.dtype, device=self.device)
            return empty, empty.clone()
        rows = self._ring_rows(state_slot)
        k = torch.stack([self.k_ring[i][rows] for i in self.ring_layers])
        v = torch.stack([self.v_ring[i][rows] for i in self.ring_layers])
        return k, v

    def write_ring(self, state_slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = self._ring_rows(state_slot)
        shape = (len(self.ring_layers), self.ring_len, self.num_kv_heads, self.head_dim)
        _check("k_ring", k, shape)
        _check("v_ring", v, shape)
        self.version += 1
        for n, i in enumerate(self.ring_layers):
            self.k_ring[i][rows] = k[n].to(self.device, self.dtype)
            self.v_ring[i][rows] = v[n].to(self.device, self.dtype)

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        if not self.ring_layers:
            return
        src, dst = self._ring_rows(src_slot), self._ring_rows(dst_slot)
        self.version += 1
        for i in self.ring_layers:
            self.k_ring[i][dst] = self.k_ring[i][src]
            self.v_ring[i][dst] = self.v_ring[i][src]

    # ---- whole sequence (KV hand-off) ----------------------------------------
    def export_shapes(self, num_tokens: int, first_block: int = 0,
                      ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        n = math.ceil(num_tokens / self.block_size) - first_block
        if n < 0:
            raise ValueError(f"{num_tokens} tokens have no block {first_block}")
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        if self.full_layers:
            shape = (len(self.full_layers), n, self.block_size, self.num_kv_heads, self.head_dim)
            out["k_blocks"] = out["v_blocks"] = (self.dtype, shape)
        if self.ring_layers:
            shape = (len(self.ring_layers), self.ring_len, self.num_kv_heads, self.head_dim)
            out["k_ring"] = out["v_ring"] = (self.dtype, shape)
        return out

    def export_into(self, block_ids: list[int], state_slot: int, num_tokens: int,
                    out: dict[str, torch.Tensor], first_block: int = 0) -> None:
        n = math.ceil(num_tokens / self.block_size)
        if n > len(block_ids):
            raise ValueError(f"{num_tokens} tokens need {n} blocks, block table has {len(block_ids)}")
        want = self.export_shapes(num_tokens, first_block)
        if set(out) != set(want):
            raise ValueError(f"KV export: expected tensors {sorted(want)}, got {sorted(out)}")
        for name, (dtype, shape) in want.items():
            _check(name, out[name], shape)
            if out[name].dtype != dtype:
                raise ValueError(f"KV tensor {name!r}: expected dtype {dtype}, got {out[name].dtype}")
        if self.full_layers:
            ids = block_ids[first_block:n]
            for key, layers in (("k_blocks", self.k_blocks), ("v_blocks", self.v_blocks)):
                _gather_into(self._kernel_pools, out[key], [layers[i] for i in self.full_layers],
                             ids, self.copy_threads)
        if self.ring_layers:
            rows = self._ring_rows(state_slot)
            for key, rings in (("k_ring", self.k_ring), ("v_ring", self.v_ring)):
                for n_layer, i in enumerate(self.ring_layers):
                    out[key][n_layer].copy_(rings[i][rows])

    def export_sequence(
        self, block_ids: list[int], state_slot: int, num_tokens: int
    ) -> dict[str, torch.Tensor]:
        out = {name: torch.empty(shape, dtype=dtype)
               for name, (dtype, shape) in self.export_shapes(num_tokens).items()}
        self.export_into(block_ids, state_slot, num_tokens, out)
        return out

    def check_import(self, tensors: dict[str, torch.Tensor], num_tokens: int,
                     skipped_blocks: int = 0) -> None:
        """Validate a payload's tensors for ``num_tokens`` positions (less the first
        ``skipped_blocks`` full blocks, which the receiver holds) without writing.

        Raises ValueError naming the tensor and the expected/actual shape or dtype."""
        n = math.ceil(num_tokens / self.block_size) - skipped_blocks
        want: dict[str, tuple[int, ...]] = {}
        if self.full_layers:
            shape = (len(self.full_layers), n, self.block_size, self.num_kv_heads, self.head_dim)
            want["k_blocks"] = want["v_blocks"] = shape
        if self.ring_layers:
            shape = (len(self.ring_layers), self.ring_len, self.num_kv_heads, self.head_dim)
            want["k_ring"] = want["v_ring"] = shape
        for key, shape in want.items():
            if key not in tensors:
                raise ValueError(f"KV import: tensor {key!r} missing")
            _check(key, tensors[key], shape)
            if tensors[key].dtype != self.dtype:
                raise ValueError(
                    f"KV tensor {key!r}: expected dtype {self.dtype}, got {tensors[key].dtype}"
                )
        extra = sorted(set(tensors) - set(want))
        if extra:
            raise ValueError(f"KV import: unexpected tensor(s) {', '.join(extra)}")

    def import_sequence(
        self, block_ids: list[int], state_slot: int, tensors: dict[str, torch.Tensor]
    ) -> None:
        if self.full_layers:
            for key in ("k_blocks", "v_blocks"):
                if key not in tensors:
                    raise ValueError(f"KV import: tensor {key!r} missing")
            n = tensors["k_blocks"].shape[1]
            if n > len(block_ids):
                raise ValueError(f"KV import: payload has {n} blocks, block table {len(block_ids)}")
            self.write_blocks(block_ids[:n], tensors["k_blocks"], tensors["v_blocks"])
        if self.ring_layers:
            for key in ("k_ring", "v_ring"):
                if key not in tensors:
                    raise ValueError(f"KV import: tensor {key!r} missing")
            self.write_ring(state_slot, tensors["k_ring"], tensors["v_ring"])


@functools.cache
def _copy_kernels(isa: str | None = None) -> ctypes.CDLL | None:
    """kv_copy.c (streaming-store block copies) built for ``isa`` (default: the CPU's
    widest, whose stores move a whole cache line at once); None: torch's."""
    lib = cbuild.load("kv_copy", isa)
    if lib is not None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for fn in (lib.kv_gather, lib.kv_scatter):
            fn.argtypes, fn.restype = [p, p, p, i64, i64], None
        for fn in (lib.kv_gather_layers, lib.kv_scatter_layers):
            fn.argtypes, fn.restype = [p, p, i64, p, i64, i64, i64, i64], ctypes.c_int
    return lib


@dataclass(frozen=True)
class _KernelPools:
    """One set of layer pools (a cache's K or V blocks) as the C kernels take them."""

    pointers: Any  # ctypes array: each layer's data_ptr
    num_blocks: int
    row_shape: torch.Size
    dtype: torch.dtype
    row_bytes: int


def _kernel_pools(known: dict, pools: list[torch.Tensor]) -> _KernelPools | None:
    """``pools`` for the C kernels: every layer's pool a contiguous CPU tensor of one
    shape and dtype, and the kernels built; None: torch's copies. Looked up in ``known``
    (the cache's own, keyed by the tensors' ids; an entry holds its tensors, so no id is
    reused while it is there): a tensor attribute read measured ~10 us in a process whose
    caches are cold, as a rank's are between hand-offs, so checking 8 layers' pools on
    every copy cost ~0.1 ms. A cache makes its pools once and writes them in place only:
    K's set and V's."""
    key = tuple(map(id, pools))
    if key in known:
        return known[key][1]
    first = pools[0]
    entry = None
    if (first.dim() >= 1
            and all(p.device.type == "cpu" and p.is_contiguous() and p.dtype == first.dtype
                    and p.shape == first.shape for p in pools)
            and _copy_kernels() is not None):
        entry = _KernelPools((ctypes.c_void_p * len(pools))(*[p.data_ptr() for p in pools]),
                             first.shape[0], first.shape[1:], first.dtype,
                             first[0].numel() * first.element_size())
    if len(known) >= 8:  # pools replaced since (nothing here does): forget the old ones
        known.clear()
    known[key] = (tuple(pools), entry)
    return entry


def _copy_layers(known: dict, fn_name: str, rows: torch.Tensor, pools: list[torch.Tensor],
                 block_ids: Any, threads: int = 1) -> bool:
    """``fn_name`` of the C kernels between ``rows`` ([layers, n, *row]) and ``pools``,
    every layer in one call (a call and its tensor ops per layer measured ~0.3 ms of each
    side of a hand-off, cold); False where they cannot (torch's copies then). The kernel
    checks the ids: IndexError, nothing copied."""
    entry = _kernel_pools(known, pools)
    if entry is None or not (rows.device.type == "cpu" and rows.dtype == entry.dtype
                             and rows.is_contiguous() and rows.shape[2:] == entry.row_shape):
        return False
    ids = array.array("q", block_ids)
    if len(ids) != rows.shape[1]:
        raise ValueError(f"{len(ids)} block ids for {rows.shape[1]} rows")
    if getattr(_copy_kernels(), fn_name)(rows.data_ptr(), entry.pointers, len(pools),
                                         ids.buffer_info()[0], len(ids), entry.num_blocks,
                                         entry.row_bytes, threads):
        raise IndexError(f"block ids outside [0, {entry.num_blocks})")
    return True


def _gather_into(known: dict, out: torch.Tensor, pools: list[torch.Tensor],
                 block_ids: list[int], threads: int = 1) -> None:
    """``out[l][j] = pools[l][block_ids[j]]`` for every layer ``l``: straight into
    ``out`` when both live on the CPU."""
    if _copy_layers(known, "kv_gather_layers", out, pools, block_ids, threads):
        return
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=pools[0].device)
    for rows, blocks in zip(out, pools, strict=True):
        if blocks.device == rows.device and blocks.dtype == rows.dtype:
            torch.index_select(blocks, 0, idx, out=rows)
        else:  # a device cache: gather there, then one copy to the host
            rows.copy_(blocks.index_select(0, idx))


def _scatter_into(known: dict, pools: list[torch.Tensor], block_ids: list[int],
                  rows: torch.Tensor, threads: int = 1) -> None:
    """``pools[l][block_ids[j]] = rows[l][j]`` for every layer ``l`` (``rows`` may be a
    read-only view of a payload)."""
    if _copy_layers(known, "kv_scatter_layers", rows, pools, block_ids, threads):
        return
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=pools[0].device)
    for blocks, layer in zip(pools, rows, strict=True):
        blocks.index_copy_(0, idx, layer.to(blocks.device, blocks.dtype))


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"KV tensor {name!r}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
