"""Section 9: opt-in policies, each run against the default on the same trace."""

from __future__ import annotations

import pytest

from pdserve.scheduler import SequenceStatus, StepKind


def _first_token_steps(kit, **policy):
    s = kit.sched(max_num_batched_tokens=4, max_num_seqs=4, prefill_attempt_interval=1, **policy)
    s.add(kit.seq("A", 12))
    s.add(kit.seq("B", 2))
    first, order = {}, []
    for step in range(1, 8):
        out, res = kit.step(s)
        if out.kind is StepKind.PROMPT:
            order.append(kit.rows(out))
        for q in res.updated:
            first.setdefault(q.attempt, step)
    return first, order


def test_continuation_at_back_lets_a_short_prompt_through(kit):
    default, default_order = _first_token_steps(kit)
    rotate, rotate_order = _first_token_steps(kit, continuation_at_back=True)
    # Default: A's unfinished prompt returns to the front and keeps the budget.
    assert default_order[:4] == [[("A", 4, 4)], [("A", 4, 8)], [("A", 4, 12)], [("B", 2, 2)]]
    assert default == {"A": 3, "B": 4}
    # Rotation: A goes to the back after each chunk, so B passes it.
    assert rotate_order[:2] == [[("A", 4, 4)], [("B", 2, 2), ("A", 2, 6)]]
    assert rotate["B"] == 2 < default["B"] and rotate["A"] > default["A"]


def _bypass_trace(kit, limit, steps=40):
    """A head needing 5 blocks waits while R holds 6 of 10; a small request (one block,
    three tokens) arrives every step, so blocks are never all free at once."""
    s = kit.sched(num_blocks=11, max_num_seqs=8, prefill_attempt_interval=1,
                  hol_bypass_limit=limit)
    r = kit.seq("R", 21, 1, max_tokens=3)  # 6 blocks, enough for its whole answer
    r.processed = 21
    s.add_prefilled(r)
    s.decode_step = 1
    kit.step(s)  # R joins running: 4 blocks free
    head = kit.seq("H", 20, max_tokens=2)
    s.add(head)
    before, first_token, head_step = [], {}, None
    for step in range(steps):
        s.add(kit.seq(f"s{step}", 2, max_tokens=3))
        out, res = kit.step(s)
        for q in res.updated:
            first_token.setdefault(q.attempt, step)
        if out.kind is StepKind.PROMPT:
            for row in out.scheduled:
                if row.attempt == head.attempt:
                    head_step = step
                elif head_step is None:
                    before.append(row.attempt)
        assert head.bypassed <= limit
    assert not r.block_table  # R finished
    return head_step, before, first_token, head


def test_bounded_bypass_with_aging_never_starves_the_head(kit):
    d_step, d_before, d_first, d_head = _bypass_trace(kit, limit=0)
    b_step, b_before, b_first, b_head = _bypass_trace(kit, limit=2)
    assert d_before == [] and d_head.bypassed == 0  # head-of-line blocking
    assert b_before == ["s0", "s1"] and b_head.bypassed == 2  # two passes, then it blocks
    assert b_first["s0"] < d_first["s0"] and b_first["s1"] <= d_first["s1"]
    # The head is admitted and finishes although small requests never stop arriving.
    assert d_step is not None and b_step is not None
    assert d_head.status.is_finished and b_head.status.is_finished
    assert b_step - d_step <= 2  # the price: at most K extra steps here


def _room_trace(kit, **policy):
    s = kit.sched(num_blocks=4, stop_preempted_request=True, **policy)
    a = kit.running(s, "A", 5, 1)  # 2 blocks hold 8 positions: room for 2 more tokens
    s.blocks.allocate(s.blocks.num_free)
    s.decode_step = 1
    return s, a, s.schedule()


def test_decode_candidate_with_room_needs_no_free_block(kit):
    _, a, out = _room_trace(kit)
    assert out.scheduled == [] and a.status is SequenceStatus.FINISHED_PREEMPTED
    s, a, out = _room_trace(kit, decode_room_needs_no_block=True)
    assert kit.names(out.scheduled) == ["A"] and out.preempted == []
    for _ in range(2):  # positions 6 and 7 still fit the 2 blocks
        s.process_outputs(out, [5])
        out = s.schedule()
        assert kit.names(out.scheduled) == ["A"]
    s.process_outputs(out, [5])
    out = s.schedule()  # position 8 needs a third block: none free, preempted after all
    assert out.preempted == [a] and a.block_table == []


def _drain_steps(kit, max_steps=400, **policy):
    """The livelock trace: V (4 tokens) then X (36) on a tiny pool with recompute.

    Default rules: V decodes, X's first chunk takes 9 blocks for its whole prompt, V is
    preempted for recompute to the FRONT of waiting and then needs 2 blocks with 1 free:
    head-of-line blocked forever while X, which owns its blocks, waits behind it.
    """
    s = kit.sched(block_size=4, num_blocks=11, num_state_slots=4, max_model_len=64,
                  max_num_batched_tokens=4, max_num_seqs=4, stop_preempted_request=False,
                  prefill_attempt_interval=5, prefill_any_attempt_interval=3, **policy)
    s.add(kit.seq("V", 4, max_tokens=8))
    s.add(kit.seq("X", 36, max_tokens=3))  # 39 tokens: fits the 10 usable blocks
    finished = {}
    for step in range(max_steps):
        if not s.has_unfinished():
            s.assert_drained()
            return step, finished
        _, res = kit.step(s, token=9)
        finished.update({q.attempt: q.finish_reason for q in res.finished})
    return None, finished


def test_partial_prompts_first_breaks_the_recompute_livelock(kit):
    default_steps, default_finished = _drain_steps(kit)
    assert default_steps is None and default_finished == {}  # the released rules wedge
    steps, finished = _drain_steps(kit, partial_prompts_first=True)
    assert steps is not None and finished == {"V": "length", "X": "length"}


# ---- the time-budget chunk sizer ----

def _true_cost(rows) -> float:
    """A prompt step's cost in seconds on an imaginary machine: fixed + per position +
    quadratic attention terms, the shape the sizer fits."""
    return (0.002 + 2e-5 * sum(q for q, _ in rows) + 4e-9 * sum(q * q for q, _ in rows)
            + 1e-8 * sum(q * c for q, c in rows))


def test_chunk_sizer_fits_a_known_cost_and_answers_the_largest_chunk():
    import random

    from pdserve.scheduler.chunk_sizer import MAX_POSITIONS, ChunkSizer

    sizer = ChunkSizer(quota_s=0.03, floor=16)
    assert sizer.budget(0) is None  # nothing measured: the token budget applies
    rng = random.Random(3)
    for _ in range(12):
        rows = [(rng.randint(64, 3000), rng.randint(0, 6000))]
        sizer.observe(rows, _true_cost(rows) * rng.uniform(0.98, 1.02))
    for cached in (0, 2000, 8000):
        q = sizer.budget(cached)
        assert _true_cost([(q, cached)]) <= 0.03 * 1.03  # within the quota (fit error)
        assert _true_cost([(q + 64, cached)]) > 0.03 * 0.97  # and not far below it
    assert sizer.budget(0) > sizer.budget(2000) > sizer.budget(8000)  # longer prefix, less q
    tight = ChunkSizer(quota_s=1e-4, floor=16)  # nothing fits: one floor-sized chunk
    loose = ChunkSizer(quota_s=1e6, floor=16)
    flat = ChunkSizer(quota_s=0.03, floor=16)  # the time does not depend on q: all fits
    for q in (100, 900, 2500, 4000, 50):
        for s in (tight, loose):
            s.observe([(q, 0)], _true_cost([(q, 0)]))
        flat.observe([(q, 0)], 0.01)
    assert tight.budget(0) == 16 and loose.budget(0) == MAX_POSITIONS
    assert flat.budget(0) == MAX_POSITIONS
    with pytest.raises(ValueError, match="quota_s"):
        ChunkSizer(quota_s=0, floor=16)


def _prompt_step_costs(kit, **policy):
    """Six 1,500-position prompts through one NORMAL scheduler whose prompt steps are
    'measured' with _true_cost; returns each prompt step's cost and the finished ids."""
    s = kit.sched(block_size=16, num_blocks=1024, max_model_len=2048, max_num_seqs=8,
                  max_num_batched_tokens=1024, prefill_attempt_interval=1, **policy)
    for i in range(6):
        s.add(kit.seq(f"p{i}", 1500, max_tokens=2))
    costs, finished = [], set()
    while s.has_unfinished():
        out = s.schedule()
        if out.kind is StepKind.PROMPT and out.scheduled:
            cost = _true_cost([(r.query_len, r.start_pos) for r in out.scheduled])
            costs.append(cost)
            s.observe_prompt_step(out, cost)
        res = s.process_outputs(out, [7 if r.sample else None for r in out.scheduled])
        finished.update(q.attempt for q in res.finished)
    s.assert_drained()
    return costs, finished


def test_time_budget_chunk_sizer_keeps_prompt_steps_under_the_quota(kit):
    """Same trace: the default token budget (1,024 positions) makes prompt steps of
    ~0.03-0.05 s; with a 0.02 s quota, once four steps are measured every prompt step
    fits the quota, and every request still finishes."""
    default, done_default = _prompt_step_costs(kit)
    sized, done_sized = _prompt_step_costs(kit, chunk_time_budget_s=0.02)
    assert done_default == done_sized == {f"p{i}" for i in range(6)}
    assert max(default) > 0.02 * 1.4
    assert all(c <= 0.02 * 1.03 for c in sized[4:])
    assert len(sized) > len(default)  # smaller steps, more of them
    assert sum(sized[4:]) / len(sized[4:]) > 0.02 * 0.8  # and not needlessly small


def test_time_budget_chunk_sizer_takes_the_minimum_across_the_group(kit, thread_group):
    """Two ranks whose measured steps differ (rank 1 twice as slow): both size their
    prompt steps by the slower one's model."""
    scheds = [kit.sched(block_size=16, num_blocks=1024, max_model_len=2048,
                        max_num_batched_tokens=1024, prefill_attempt_interval=1,
                        chunk_time_budget_s=0.02) for _ in range(2)]
    for rank, s in enumerate(scheds):
        for q in (200, 700, 1024, 400, 900):
            s.chunk_sizer.observe([(q, 0)], _true_cost([(q, 0)]) * (1 + rank))
        s.add(kit.seq(f"long{rank}", 2000, max_tokens=2))
    group = thread_group(2)
    for rank, s in enumerate(scheds):
        s.comm = group.communicator(rank)
    outs = group.run(lambda rank: scheds[rank].schedule())
    slow = scheds[1].chunk_sizer.budget(0)
    assert scheds[0].chunk_sizer.budget(0) > slow
    assert [o.kind for o in outs] == [StepKind.PROMPT, StepKind.PROMPT]
    assert slow < 2000  # a chunk, not the whole prompt
    assert [o.scheduled[0].query_len for o in outs] == [slow, slow]
    assert group.calls == [3, 3]  # the try vote, the budget, the result vote


def test_time_budget_chunk_sizer_config_is_checked(kit):
    with pytest.raises(ValueError, match="chunk_time_budget_s"):
        kit.config(chunk_time_budget_s=-1.0)
    with pytest.raises(ValueError, match="chunked_prefill"):
        kit.config(chunk_time_budget_s=0.1, chunked_prefill=False)
    assert kit.sched().chunk_sizer is None  # off by default: no extra collective


def test_a_moved_request_queues_ahead_of_new_arrivals_behind_begun_prompts(kit):
    """A request moved here off a dead rank has waited already: it passes the fresh
    arrivals, not a prompt already begun nor a request moved before it."""
    s = kit.sched(max_num_batched_tokens=4, max_num_seqs=4, prefill_attempt_interval=1)
    s.add(kit.seq("begun", 12, max_tokens=2))
    kit.step(s)  # its first chunk: it waits at the front with blocks
    s.add(kit.seq("fresh1", 2, max_tokens=2))
    s.add(kit.seq("fresh2", 2, max_tokens=2))
    first, second = kit.seq("moved1", 3, max_tokens=2), kit.seq("moved2", 3, max_tokens=2)
    first.moved = second.moved = True
    s.add(first)
    s.add(second)
    assert kit.names(s.waiting) == ["begun", "moved1", "moved2", "fresh1", "fresh2"]
    order = []
    for _ in range(20):
        out, _ = kit.step(s)
        if out.kind is StepKind.PROMPT:
            order += [r.attempt for r in out.scheduled if r.attempt not in order]
    assert order == ["begun", "moved1", "moved2", "fresh1", "fresh2"]


def test_a_moved_request_keeps_fifo_among_fresh_arrivals_when_none_waits(kit):
    s = kit.sched()
    moved = kit.seq("moved", 3)
    moved.moved = True
    s.add(moved)
    s.add(kit.seq("fresh", 3))
    assert kit.names(s.waiting) == ["moved", "fresh"]
