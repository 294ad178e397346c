"""One allocation on 2 MiB pages for the weights a decode step sweeps.

    arena = Arena(sum(Arena.footprint(t) for t in tensors))
    views = [arena.take(t) for t in tensors]   # same shapes, dtypes and values

Why: a decode step reads every matmul's weights once, about 96 MB for the packaged
model's quantized panels, from several hundred separate tensors on 4 KiB pages: a
TLB miss every 4 KiB of the sweep, and Linux's default ``madvise`` mode for
transparent huge pages gives none to memory that does not ask. Gathered here, with
``MADV_HUGEPAGE`` asked before the first touch, a one-row step of the real model ran
0.964-0.974x the time of the same weights on 4 KiB pages (16 rows: unchanged; two
engines in one process, rounds alternating; docs/models.md). Nothing else changes:
values are copied bit for bit, and where the OS has no huge pages (not Linux, THP
``never``) the arena is plain memory.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each view starts on a cache line, as torch's allocator does


class Arena:
    """``nbytes`` of memory, 2 MiB aligned and advised onto huge pages before anything
    is written, handed out in order by ``take``."""

    def __init__(self, nbytes: int):
        if nbytes < 0:
            raise ValueError(f"an arena's size must be >= 0, got {nbytes}")
        # A fresh mapping, not torch.empty: malloc may answer from heap memory that the
        # load's temporaries already touched, where the advice comes too late (seen: a
        # 92 MB arena with no huge page). Private: a shared anonymous mapping is shmem,
        # which THP leaves out by default. Over-allocated by a page so that the used part
        # starts on a 2 MiB boundary.
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._memory = torch.frombuffer(self._map, dtype=torch.uint8)
        self._start = -self._memory.data_ptr() % HUGE_PAGE
        self.nbytes = nbytes
        self.used = 0
        span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        self.advised = False
        if hasattr(mmap, "MADV_HUGEPAGE") and span:  # Linux
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, self._start, span)
                self.advised = True
            except OSError:  # a kernel without transparent huge pages
                pass

    @staticmethod
    def footprint(t: torch.Tensor) -> int:
        """Bytes ``take(t)`` uses of an arena."""
        return -(-t.numel() * t.element_size() // ALIGN) * ALIGN

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (a CPU tensor) in the arena: same shape, dtype and values,
        contiguous."""
        size = self.footprint(t)
        if t.device.type != "cpu":
            raise ValueError(f"an arena holds CPU tensors, got one on {t.device}")
        if self.used + size > self.nbytes:
            raise ValueError(f"arena full: {self.used} of {self.nbytes} bytes used, "
                             f"{size} more asked")
        at = self._start + self.used
        nbytes = t.numel() * t.element_size()
        view = self._memory[at:at + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        self.used += size
        return view
