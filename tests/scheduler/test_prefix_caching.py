"""Prefix caching in the scheduler (scheduler/PREFIX_CACHING.md): each rule it changes.

With ``enable_prefix_caching`` a finished sequence's full blocks stay in the free list
under their hash (evictable) and a new sequence takes the longest cached run of its
full blocks, never the block with its last token, starting its processed count after
it. Free still means "no reference" (S2, S5, S35): a drained scheduler has every block
free, some of them cached."""

from __future__ import annotations

from pdserve.scheduler import EngineType, SamplingParams, Sequence
from pdserve.scheduler.prefix_hash import cacheable_blocks, chain_hashes


def finish(kit, sched, seq, token=7, limit=200):
    """Step until ``seq`` finishes (every row samples ``token``)."""
    for _ in range(limit):
        if seq.status.is_finished:
            return
        kit.step(sched, token)
    raise AssertionError(f"{seq.attempt} never finished")


def prompt_step(kit, sched, limit=200):
    """Step until a prompt step runs rows (a NORMAL scheduler tries prefill only at its
    vote points); that step's output."""
    from pdserve.scheduler.output import StepKind

    for _ in range(limit):
        out, _ = kit.step(sched)
        if out.kind == StepKind.PROMPT and out.scheduled:
            return out
    raise AssertionError("no prompt step ran")


def prompt(n, start=1):
    return [start + i % 50 for i in range(n)]


def new(name, ids, max_tokens=2):
    return Sequence(name, list(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    eos_token_id=0)


def test_hashes_chain_and_never_cover_the_last_token():
    ids = prompt(9)
    a = chain_hashes(ids, 4, 2)
    assert chain_hashes(ids, 4, 1) == a[:1]  # a prefix's hashes are a prefix
    assert chain_hashes(ids, 4, 2, previous=a[:1]) == a
    other = list(ids)
    other[1] += 1  # block 0 differs: block 1's hash differs too, though its tokens match
    b = chain_hashes(other, 4, 2)
    assert b[0] != a[0] and b[1] != a[1]
    assert cacheable_blocks(8, 4) == 1 and cacheable_blocks(9, 4) == 2
    assert cacheable_blocks(1, 4) == 0 and cacheable_blocks(0, 4) == 0


def test_a_repeated_prompt_starts_after_its_cached_blocks(kit):
    sched = kit.sched(enable_prefix_caching=True)
    ids = prompt(18)  # 4 full blocks and 2 tokens
    a = new("a", ids)
    sched.add(a)
    out, _ = kit.step(sched)
    assert kit.rows(out) == [("a", 18, 18)]
    finish(kit, sched, a)
    free = sched.blocks.num_free
    assert free == sched.config.num_blocks - 1  # S35: all free, 4 of them cached
    assert sched.blocks.num_cached == 4  # positions 0..15 computed (19 of its 20 were)
    b = new("b", ids)
    sched.add(b)
    out = prompt_step(kit, sched)
    assert kit.rows(out) == [("b", 2, 18)]  # only the tokens after the cached 16
    assert b.num_cached_tokens == 16 and b.block_table[:4] == a_blocks(sched, ids)
    assert sched.num_cache_hit_tokens == 16
    finish(kit, sched, b)
    sched.assert_drained()


def a_blocks(sched, ids):
    return sched.blocks.lookup(chain_hashes(ids, sched.config.block_size, 4))


def test_a_prompt_of_whole_blocks_recomputes_its_last_block(kit):
    sched = kit.sched(enable_prefix_caching=True)
    ids = prompt(16)
    a = new("a", ids)
    sched.add(a)
    finish(kit, sched, a)
    b = new("b", ids)
    sched.add(b)
    out = prompt_step(kit, sched)
    assert kit.rows(out) == [("b", 4, 16)]  # never its last token: the last block again
    finish(kit, sched, b)
    sched.assert_drained()


def test_shared_blocks_are_referenced_once_per_holder(kit):
    """S1 with caching: a cached block two running sequences took has two references,
    and stays out of the free list until both are done."""
    sched = kit.sched(enable_prefix_caching=True)
    ids = prompt(12)
    a = new("a", ids)
    sched.add(a)
    finish(kit, sched, a)
    b, c = new("b", ids + [3], max_tokens=50), new("c", ids + [4], max_tokens=50)
    sched.add(b)
    sched.add(c)
    prompt_step(kit, sched)
    shared = b.block_table[:3]
    assert c.block_table[:3] == shared
    assert [sched.blocks.refcount(i) for i in shared] == [2, 2, 2]
    assert not set(shared) & set(sched.blocks.free_ids)
    sched.abort("b")
    kit.step(sched)
    assert [sched.blocks.refcount(i) for i in shared] == [1, 1, 1]
    sched.abort("c")
    kit.step(sched)
    assert set(shared) <= set(sched.blocks.free_ids)  # evictable, still cached
    assert sched.blocks.lookup(chain_hashes(ids, 4, 3)) == shared
    sched.assert_drained()


def test_eviction_takes_the_oldest_freed_and_forgets_its_hash(kit):
    """S3 with caching: allocation takes the oldest free block, cached or not; taking a
    cached one evicts its hash, so the next lookup misses it."""
    sched = kit.sched(enable_prefix_caching=True, num_blocks=9)  # 8 usable
    ids = prompt(9)  # 2 full blocks + 1
    a = new("a", ids)
    sched.add(a)
    finish(kit, sched, a)
    assert sched.blocks.num_cached == 2
    big = new("big", prompt(32, start=60), max_tokens=1)  # all 8 blocks
    sched.add(big)
    finish(kit, sched, big)
    assert sched.blocks.num_evictions >= 2
    assert sched.blocks.lookup(chain_hashes(ids, 4, 2)) == []
    events = sched.blocks.drain_events()
    evicted = {h for stored, h in events if not stored}
    assert set(chain_hashes(ids, 4, 2)) <= evicted
    sched.assert_drained()


def test_a_hit_that_must_leave_the_free_list_counts_against_the_pool(kit):
    """S3/S14 with caching: cached blocks sitting in the free list are part of what a
    fresh prompt takes from it; it waits (LATER) when they and its new blocks do not
    fit, rather than counting them twice."""
    sched = kit.sched(enable_prefix_caching=True, num_blocks=7)  # 6 usable
    ids = prompt(12)  # 3 blocks
    a = new("a", ids)
    sched.add(a)
    finish(kit, sched, a)
    assert sched.blocks.num_cached == 3
    held = sched.blocks.allocate(3)  # the 3 uncached free blocks: 3 cached ones left
    b = new("b", ids + [5, 6, 7, 8, 9])  # 5 blocks: 3 cached (free) + 2 new
    sched.add(b)
    hits = sched._cached_prefix(b)
    assert len(hits) == 3 and sched.blocks.num_free == 3
    assert sched._check_fresh(b, hits).name == "LATER"
    sched.blocks.free(held)
    assert sched._check_fresh(b, hits).name == "OK"
    finish(kit, sched, b)
    assert b.num_cached_tokens == 12
    sched.assert_drained()


def test_recompute_after_preemption_reuses_its_own_blocks(kit):
    """S30 with caching: a preempted sequence's computed blocks stay cached, so its
    recompute only computes what was never cached."""
    sched = kit.sched(enable_prefix_caching=True, stop_preempted_request=False)
    s = new("s", prompt(10), max_tokens=30)
    sched.add(s)
    for _ in range(12):
        kit.step(sched)
    history = len(s)
    sched.running.remove(s)
    sched._preempt(s, _out())  # recompute (S30)
    out = prompt_step(kit, sched)
    row = kit.rows(out)[0]
    assert row[0] == "s" and row[2] == history
    assert row[1] <= 4 + history % 4  # only the tail past the last cached block
    finish(kit, sched, s)
    sched.assert_drained()


def _out():
    from pdserve.scheduler.output import SchedulerOutput, StepKind
    return SchedulerOutput(StepKind.DECODE)


def test_prompt_engine_caches_across_hand_offs(kit):
    sched = kit.sched(EngineType.PROMPT, enable_prefix_caching=True)
    ids = prompt(20)
    for name in ("a", "b"):
        seq = new(name, ids)
        sched.add(seq)
        out, res = kit.step(sched)
        assert [s.attempt for s in res.handed_off] == [name]
        sched.release_handed_off(seq)
    assert kit.rows(out) == [("b", 4, 20)]
    sched.assert_drained()


def test_off_by_default_for_the_rule_tests(kit):
    sched = kit.sched()
    assert not sched.caching and type(sched.blocks).__name__ == "BlockPool"
