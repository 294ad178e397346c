"""Section 5: the prefill path (S12-S25)."""

from __future__ import annotations

import pytest

from pdserve.scheduler import EngineType, SequenceStatus, StepKind

PROMPT = EngineType.PROMPT


def test_s12_finished_head_moves_to_ignored_and_pass_continues(kit):
    s = kit.sched(PROMPT)
    s.add(kit.seq("A", 4))
    s.add(kit.seq("B", 4))
    assert s.abort("A")
    out = s.schedule()
    assert kit.names(out.ignored) == ["A"] and kit.names(out.scheduled) == ["B"]
    assert out.ignored[0].status is SequenceStatus.FINISHED_ABORTED


def test_s13_unschedulable_head_stops_the_pass(kit):
    s = kit.sched(PROMPT)
    head = kit.seq("A", 4)
    head.schedulable = False
    s.add(head)
    s.add(kit.seq("B", 4))
    out = s.schedule()
    assert out.scheduled == [] and kit.names(s.waiting) == ["A", "B"]
    head.schedulable = True
    assert kit.names(s.schedule().scheduled) == ["A", "B"]


def test_s14_later_blocks_head(kit):
    s = kit.sched(PROMPT, num_blocks=8)  # 7 usable
    s.blocks.allocate(4)  # 3 free
    s.add(kit.seq("big", 16))  # needs 4 blocks: possible later
    s.add(kit.seq("small", 4))  # needs 1 and would fit now
    out = s.schedule()
    assert out.scheduled == [] and out.ignored == []
    assert kit.names(s.waiting) == ["big", "small"]  # head-of-line blocking


def test_s14_never_and_too_long_are_ignored_and_pass_continues(kit):
    s = kit.sched(PROMPT, num_blocks=8, max_model_len=40)
    s.add(kit.seq("toolong", 41))  # > prompt_limit (max_model_len with chunking)
    s.add(kit.seq("never", 32))  # 8 blocks >= num_blocks: NEVER
    s.add(kit.seq("ok", 4))
    out = s.schedule()
    assert kit.names(out.ignored) == ["toolong", "never"]
    assert all(q.status is SequenceStatus.FINISHED_IGNORED for q in out.ignored)
    assert out.ignored[0].finish_reason == "prompt_length_exceeded"
    assert kit.names(out.scheduled) == ["ok"] and not s.waiting
    assert s.blocks.num_free == 6  # ignored prompts allocated nothing


@pytest.mark.filterwarnings("ignore:chunked_prefill is off")
def test_s14_prompt_limit_without_chunking(kit):
    s = kit.sched(PROMPT, chunked_prefill=False, max_model_len=64, max_num_batched_tokens=16)
    s.add(kit.seq("A", 17))  # prompt_limit = min(64, 16)
    s.add(kit.seq("B", 16))
    out = s.schedule()
    assert kit.names(out.ignored) == ["A"] and kit.names(out.scheduled) == ["B"]


def _parent_mid_prompt(kit, sched):
    """A 20-token prompt whose first chunk (6 positions) is cached, back at the head."""
    parent = kit.seq("P", 20)
    parent.checkpoints = [6]
    sched.add(parent)
    out, _ = kit.step(sched)
    assert kit.rows(out) == [("P", 6, 6)] and parent.processed == 6
    assert parent.block_table == [1, 2, 3, 4, 5]
    return parent


def test_s15_fork_with_incomplete_prompt_keeps_full_blocks_copies_partial(kit):
    s = kit.sched(PROMPT, num_blocks=16)
    parent = _parent_mid_prompt(kit, s)
    child = s.fork(parent, "C")
    assert s.waiting[0] is child and child.block_table == [1, 2, 3, 4, 5]
    out = s.schedule()
    assert out.scheduled[0].attempt == child.attempt
    # Keeps block 1 (positions 0-3, full), copies the partial block 2 (positions 4-5),
    # drops 3-5 and allocates the rest of its 5 blocks; clones the state slot.
    assert child.block_table[0] == 1 and s.blocks.refcount(1) == 2
    assert out.block_copies == [(2, child.block_table[1])]
    assert out.state_copies == [(parent.state_slot, child.state_slot)]
    assert len(child.block_table) == 5 and set(child.block_table[1:]).isdisjoint({2, 3, 4, 5})
    assert all(s.blocks.refcount(b) == 1 for b in (2, 3, 4, 5))
    assert child.state_slot != parent.state_slot and s.states.refcount(parent.state_slot) == 1


def test_s15_fork_later_stops_the_pass(kit):
    s = kit.sched(PROMPT, num_blocks=8)
    parent = _parent_mid_prompt(kit, s)  # owns 5 of 7 blocks
    child = s.fork(parent, "C")
    s.blocks.allocate(1)  # 1 free; the child needs 1 copy of its partial block + 3 more
    s.add(kit.seq("D", 1))
    out = s.schedule()
    assert out.scheduled == [] and list(s.waiting)[:2] == [child, parent]


def test_s16_max_num_seqs_counts_running(kit):
    s = kit.sched(PROMPT, max_num_seqs=2)
    for name in "ABC":
        s.add(kit.seq(name, 4))
    out = s.schedule()
    assert kit.names(out.scheduled) == ["A", "B"] and kit.names(s.waiting) == ["C"]

    n = kit.sched(max_num_seqs=2)
    kit.running(n, "R", 4, 1)
    kit.admit_prompted(n)
    for name in "AB":
        n.add(kit.seq(name, 4))
    assert kit.names(n.schedule().scheduled) == ["A"]  # one running + one new


def test_s17_sum_seqlen_k_charges_whole_length(kit):
    s = kit.sched(PROMPT, prefill_max_sum_seqlen_k=20, max_model_len=20)
    for name in "ABC":
        s.add(kit.seq(name, 8))
    assert kit.names(s.schedule().scheduled) == ["A", "B"]  # 20 - 16 = 4 < 8

    def chunked_then_small(limit):
        t = kit.sched(PROMPT, prefill_max_sum_seqlen_k=limit, max_model_len=30,
                      max_num_batched_tokens=16)
        a = kit.seq("A", 30)
        a.checkpoints = [10]  # A's chunk has 10 keys but A's whole length is 30
        t.add(a)
        t.add(kit.seq("B", 3))
        return kit.rows(t.schedule())

    assert chunked_then_small(30) == [("A", 10, 10)]
    assert chunked_then_small(None) == [("A", 10, 10), ("B", 3, 3)]


def test_s18_allowance_is_aligned_remaining_budget(kit):
    # The chapter's numbers: T = 259, U = 252, a = 4 leaves 4 positions.
    s = kit.sched(PROMPT, cp_size=2, max_num_batched_tokens=259, max_num_seqs=256,
                  num_blocks=200, max_model_len=512)
    s.add(kit.seq("A", 250))  # charged ceil(250 / 4) * 4 = 252
    s.add(kit.seq("B", 7))
    out = s.schedule()
    assert kit.rows(out) == [("A", 250, 250), ("B", 4, 4)]
    assert out.num_batched_tokens == 256
    assert out.scheduled[1].sample is False  # B is chunked


def test_s19_checkpoints_cut_chunks_exactly(kit):
    s = kit.sched(PROMPT)
    a = kit.seq("A", 20)
    a.checkpoints = [0, 5, 12]
    s.add(a)
    chunks = []
    while a.status is SequenceStatus.WAITING:
        out, _ = kit.step(s)
        chunks.append(kit.rows(out)[0][1:])
    assert chunks == [(5, 5), (7, 12), (8, 20)]
    assert a.checkpoints == []  # 0 dropped as already passed, 5 and 12 consumed


def test_s20_zero_chunk_stops_the_pass(kit):
    s = kit.sched(PROMPT, max_num_batched_tokens=16)
    s.add(kit.seq("A", 16))
    s.add(kit.seq("B", 4))
    s.add(kit.seq("C", 4))
    s.abort("C")  # behind B: only swept if the pass went on past B
    out = s.schedule()
    assert kit.names(out.scheduled) == ["A"] and out.ignored == []
    assert kit.names(s.waiting) == ["B", "C"]


@pytest.mark.filterwarnings("ignore:chunked_prefill is off")
def test_s21_chunk_with_chunking_off_stops_the_pass(kit):
    def run(chunked):
        s = kit.sched(PROMPT, chunked_prefill=chunked, max_num_batched_tokens=16, max_model_len=16)
        s.add(kit.seq("A", 10))
        s.add(kit.seq("B", 10))
        s.add(kit.seq("C", 2))
        return kit.rows(s.schedule())

    assert run(False) == [("A", 10, 10)]
    assert run(True) == [("A", 10, 10), ("B", 6, 6)]


def test_s22_chunk_shorter_than_lookahead_stops(kit):
    def run(lookahead):
        s = kit.sched(PROMPT, lookahead_tokens=lookahead, max_num_batched_tokens=13,
                      max_num_seqs=8)
        s.add(kit.seq("A", 10))
        s.add(kit.seq("B", 10))
        return kit.rows(s.schedule())

    assert run(4) == [("A", 10, 10)]
    assert run(3) == [("A", 10, 10), ("B", 3, 3)]


def test_s23_commit_charges_aligned_allocates_and_sets_status(kit):
    s = kit.sched(PROMPT, cp_size=2, max_num_batched_tokens=20, max_num_seqs=8)
    a, b = kit.seq("A", 5), kit.seq("B", 30)
    s.add(a)
    s.add(b)
    out = s.schedule()
    # A: 5 useful, 8 charged; B gets floor((20 - 8) / 4) * 4 = 12 of 30.
    assert kit.rows(out) == [("A", 5, 5), ("B", 12, 12)] and out.num_batched_tokens == 20
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    assert (a.in_flight, b.in_flight) == (5, 12)
    assert len(a.block_table) == 2 and len(b.block_table) == 8
    assert a.state_slot > 0 and b.state_slot > 0 and not s.waiting  # both popped
    table = list(b.block_table)
    s.process_outputs(out, [9, None])
    assert s.waiting[0] is b and b.processed == 12 and b.in_flight == 0
    out = s.schedule()
    # The remaining 18 fit the 20 allowance; they are charged 20.
    assert kit.rows(out) == [("B", 18, 30)] and out.num_batched_tokens == 20
    assert b.block_table == table  # no new allocation for a later chunk


def test_s24_normal_engine_stops_after_a_chunk(kit):
    def run(engine):
        s = kit.sched(engine, max_num_batched_tokens=32)
        a = kit.seq("A", 20)
        a.checkpoints = [6]
        s.add(a)
        s.add(kit.seq("B", 4))
        return kit.names(s.schedule().scheduled)

    assert run(EngineType.NORMAL) == ["A"]
    assert run(EngineType.PROMPT) == ["A", "B"]


def test_s25_empty_result_normal_defers_to_vote_others_return(kit):
    def blocked(engine):
        s = kit.sched(engine, num_blocks=8)
        s.blocks.allocate(4)
        s.add(kit.seq("big", 16))
        return s

    normal = blocked(EngineType.NORMAL)
    assert normal._schedule_prefill(normal._prefill_budget()) is None
    assert normal.schedule().kind is StepKind.DECODE
    out = blocked(PROMPT).schedule()
    assert out.kind is StepKind.PROMPT and out.scheduled == [] and out.ignored == []
    s = kit.sched(max_model_len=8)
    s.add(kit.seq("toolong", 9))
    out = s.schedule()  # ignoring something is a result
    assert out.kind is StepKind.PROMPT and kit.names(out.ignored) == ["toolong"]
