"""Section 3: the block pool, state slots, blocks needed, cache usage (S1-S5)."""

from __future__ import annotations

import pytest

from pdserve.scheduler import AllocStatus, BlockPool, EngineType


def test_s01_fifo_free_list_reserved_zero_and_refcounts():
    pool = BlockPool(6)
    assert pool.free_ids == [1, 2, 3, 4, 5]  # id 0 is never handed out
    a = pool.allocate(2)
    b = pool.allocate(1)
    assert (a, b) == ([1, 2], [3])  # allocation takes the front
    pool.free(a)
    assert pool.free_ids == [4, 5, 2, 1]  # a table returns last block first, to the back
    pool.pin(b)
    assert pool.refcount(3) == 2
    pool.free(b)
    assert 3 not in pool.free_ids  # still referenced once
    pool.free(b)
    assert pool.free_ids[-1] == 3 and pool.refcount(3) == 0
    everything = pool.allocate(5)
    assert 0 not in everything and sorted(everything) == [1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError):
        pool.pin([0])
    pool.free(everything)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([1])
    assert pool.leaks() == []


def test_s02_can_allocate_never_ok_later():
    pool = BlockPool(5)  # four usable ids
    assert pool.can_allocate(5) is AllocStatus.NEVER
    assert pool.can_allocate(6) is AllocStatus.NEVER
    assert pool.can_allocate(4) is AllocStatus.OK
    pool.allocate(2)
    assert pool.can_allocate(3) is AllocStatus.LATER  # possible once something is freed
    assert pool.can_allocate(2) is AllocStatus.OK


def test_s03_no_free_state_slot_turns_ok_into_later(kit):
    # One usable state slot (slot 0 is reserved like block 0); plenty of blocks.
    s = kit.sched(EngineType.PROMPT, num_state_slots=2)
    s.add(kit.seq("A", 4))
    s.add(kit.seq("B", 4))
    s.add(kit.seq("C", 4))
    out = s.schedule()
    assert kit.names(out.scheduled) == ["A"]
    assert kit.names(s.waiting) == ["B", "C"]  # B got LATER (no slot) and blocked C
    assert out.ignored == []
    assert s.can_admit_prefilled(4) is AllocStatus.LATER
    assert s.can_admit_prefilled(10_000) is AllocStatus.NEVER  # NEVER stays NEVER
    assert s.states.free_ids == [] and A_slot(out) == 1


def A_slot(out):
    return out.scheduled[0].state_slot


def test_s04_blocks_needed_and_whole_prompt_reserved_when_chunked(kit):
    s = kit.sched(EngineType.PROMPT, max_num_batched_tokens=8, max_num_seqs=8)
    a = kit.seq("A", 30)
    s.add(a)
    out = s.schedule()
    assert kit.rows(out) == [("A", 8, 8)]  # only 8 positions computed...
    assert len(a.block_table) == 8  # ...but ceil(30 / 4) blocks reserved at admission
    assert s.blocks_needed(a) == 8 + 2  # len 30 + 8 in flight -> ceil(38 / 4)
    a.draft_len = 3
    assert s.blocks_needed(a) == 11  # ceil(41 / 4)


def test_s05_cache_usage_is_used_over_num_blocks(kit):
    s = kit.sched(num_blocks=20)
    assert s.cache_usage == 0.0
    s.blocks.allocate(18)
    assert s.cache_usage == pytest.approx(18 / 20)
    assert s.num_free_blocks == 1
