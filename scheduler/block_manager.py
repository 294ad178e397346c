"""The scheduler's storage side: each sequence's KV blocks and state slot.

Plain ids, never tensors: what the device must copy (a fork's own copy of a shared
partial block or of a state slot) goes out as (src, dst) pairs in the step's
``SchedulerOutput``. Sizes and room (S3-S5), growing and shrinking a table (S28),
copy-on-write for forks (S15, S27), freeing (S35), and prefix caching's naming and
taking of full blocks (scheduler/PREFIX_CACHING.md).
"""

from __future__ import annotations

from pdserve.scheduler.block_pool import AllocStatus, BlockPool, CachingBlockPool
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.prefix_hash import cacheable_blocks, chain_hashes
from pdserve.scheduler.sequence import Sequence


class BlockManager:
    """The KV block pool and the state-slot pool, and what a sequence holds of them.
    The ``Scheduler`` is one (it inherits these methods)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.caching = config.enable_prefix_caching
        self.blocks = CachingBlockPool(config.num_blocks) if self.caching else BlockPool(
            config.num_blocks)
        self.num_cache_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_cache_hit_tokens = 0  # ... and found there
        self._block_size = config.block_size
        self.states = BlockPool(config.num_state_slots)

    # ---- sizes and room ----

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def cache_usage(self) -> float:
        return self.blocks.num_used / self.config.num_blocks  # S5

    def cache_events(self) -> list[tuple[bool, bytes]]:
        """Prefix caching: (stored?, block hash) as blocks gained or lost their names
        since the last call, in order (the router's index of who holds which prefix)."""
        return self.blocks.drain_events() if self.caching else []

    def blocks_needed(self, seq: Sequence) -> int:
        return self._ceil_blocks(len(seq) + seq.in_flight + seq.draft_len)  # S4

    def _ceil_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _partial_blocks(self, num_tokens: int) -> int:
        """1 if the last of ``num_tokens`` positions sits in a partly filled block."""
        return 1 if num_tokens % self.config.block_size else 0

    def _can_allocate_with_state(self, num_blocks: int) -> AllocStatus:
        status = self.blocks.can_allocate(num_blocks)  # S3
        if status is AllocStatus.OK and self.states.num_free == 0:
            return AllocStatus.LATER
        return status

    def _can_allocate_group(self, num_blocks: int, num_states: int) -> AllocStatus:
        if num_states == 1:
            return self._can_allocate_with_state(num_blocks)
        return max(self.blocks.can_allocate(num_blocks), self.states.can_allocate(num_states),
                   key=lambda status: status.value)

    def _fork_blocks_status(self, seq: Sequence) -> AllocStatus:
        keep = self._ceil_blocks(seq.processed)
        new = self.blocks_needed(seq) - keep + (1 if seq.processed % self.config.block_size else 0)
        return self._can_allocate_with_state(new)

    # ---- a sequence's table ----

    def _append_slot(self, seq: Sequence) -> None:
        """Grow the table by one block when the next position needs it (more when a draft
        does: the decode path cut the draft to blocks that are free); shrink a table
        longer than needed (S28)."""
        table = seq.block_table
        bs = self._block_size
        need = (len(seq.token_ids) + seq.in_flight + seq.draft_len + bs - 1) // bs  # S4
        have = len(table)
        if have < need:  # one block, or more for a draft's positions (S4)
            for _ in range(need - have):
                table.append(self.blocks.allocate_one())
        elif have > need:
            self.blocks.free(table[need:])
            del table[need:]

    def _unshare(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Keep the shared full blocks that cover processed positions, copy the partial
        last one, drop the rest and clone the state slot (S15, S27)."""
        table = seq.block_table
        keep = self._ceil_blocks(seq.processed)
        if len(table) > keep:
            self.blocks.free(table[keep:])
            del table[keep:]
        full = seq.processed // self.config.block_size
        if full < keep:
            new = self.blocks.allocate_one()
            out.block_copies.append((table[full], new))
            self.blocks.free_one(table[full])
            table[full] = new
        new_slot = self.states.allocate_one()
        out.state_copies.append((seq.state_slot, new_slot))
        self.states.free_one(seq.state_slot)
        seq.state_slot = new_slot
        seq.fork_pending = False

    def _free_resources(self, seq: Sequence) -> None:
        seq.num_registered = 0
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
        if seq.state_slot != -1:
            self.states.free_one(seq.state_slot)
            seq.state_slot = -1

    # ---- blocks held outside a sequence ----

    def reserve_blocks(self, num_blocks: int) -> list[int] | None:
        """Blocks for KV streamed ahead of its request (a COMPLETION engine's partial
        import), referenced until ``add_prefilled`` takes them or ``release_blocks``;
        None without room."""
        if self.blocks.can_allocate(num_blocks) != AllocStatus.OK:
            return None
        return self.blocks.allocate(num_blocks)

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop references taken by ``take_cached_prefix`` for an import that never ran."""
        if block_ids:
            self.blocks.free(block_ids)

    # ---- prefix caching ----

    def take_cached_prefix(self, token_ids: list[int], num_blocks: int) -> list[int] | None:
        """Prefix caching, a prefilled import's side: reference the cached blocks of the
        first ``num_blocks`` full blocks of ``token_ids``; None (nothing taken) unless
        all of them are cached."""
        if not self.caching:
            return None
        hits = self.blocks.lookup(chain_hashes(token_ids, self.config.block_size, num_blocks))
        if len(hits) < num_blocks:
            return None
        self.blocks.take(hits)
        return hits

    def register_prefilled(self, seq: Sequence) -> None:
        """Prefix caching: an imported prompt's blocks hold its KV now: name them."""
        if self.caching:
            self._register_full_blocks(seq)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Prefix caching: the cached blocks of the longest run of its history's full
        blocks (never the one with its last token), to take when it is scheduled."""
        if not self.caching:
            return []
        bs = self.config.block_size
        n = cacheable_blocks(len(seq), bs)
        if len(seq.block_hashes) < n:
            seq.block_hashes = chain_hashes(seq.token_ids, bs, n, seq.block_hashes)
        return self.blocks.lookup(seq.block_hashes[:n])

    def _take_cached_prefix(self, seq: Sequence, hits: list[int]) -> None:
        bs = self.config.block_size
        self.blocks.take(hits)
        seq.block_table = list(hits)
        seq.num_registered = len(hits)
        seq.processed = len(hits) * bs
        self.num_cache_queried_tokens += len(seq)
        self.num_cache_hit_tokens += seq.processed
        if seq.output_len == 0 and not seq.num_cached_tokens:  # its prompt, not a recompute
            seq.num_cached_tokens = seq.processed

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Prefix caching: name each block whose positions are all computed now."""
        bs = self.config.block_size
        full = seq.processed // bs
        if full <= seq.num_registered:
            return
        if len(seq.block_hashes) < full:
            seq.block_hashes = chain_hashes(seq.token_ids, bs, full, seq.block_hashes)
        table, hashes, register = seq.block_table, seq.block_hashes, self.blocks.register
        for i in range(seq.num_registered, full):
            register(table[i], hashes[i])
        seq.num_registered = full

    def _leaks(self) -> list[str]:
        """Why the pools are not drained, if they are not."""
        problems = [f"blocks: {p}" for p in self.blocks.leaks()]
        return problems + [f"state slots: {p}" for p in self.states.leaks()]
