"""Section 6: the decode path (S26-S29)."""

from __future__ import annotations

from pdserve.scheduler import EngineType, SequenceStatus, StepKind
from pdserve.scheduler.decode_path import decode_priority

COMPLETION = EngineType.COMPLETION


def _decode(s):
    s.decode_step = max(s.decode_step, 1)  # not an attempt point: a NORMAL engine decodes
    out = s.schedule()
    assert out.kind is StepKind.DECODE
    return out


def test_s26_finished_leave_running_and_are_swept_from_waiting(kit):
    s = kit.sched()
    a, b = kit.running(s, "A", 4, 1), kit.running(s, "B", 4, 1)
    kit.admit_prompted(s)
    x, y = kit.seq("X", 4), kit.seq("Y", 4)
    x.schedulable = False
    s.add(x)
    s.add(y)
    s.abort("A")
    s.abort("Y")  # mid-queue, behind an unschedulable head
    a_block = a.block_table[0]
    out = _decode(s)
    assert {q.attempt for q in out.ignored} == {"A", "Y"}
    assert s.running == [b] and list(s.waiting) == [x]
    assert a.block_table == [] and a.state_slot == -1
    assert a_block in s.blocks.free_ids or a_block in b.block_table  # freed (and maybe reused)


def test_s27_prompted_admission_respects_max_num_seqs_and_aborts(kit):
    s = kit.sched(COMPLETION, max_num_seqs=2)
    a, b, c, d = (kit.running(s, n, 4, 1) for n in "ABCD")
    s.abort("A")
    out = s.schedule()
    assert kit.names(out.ignored) == ["A"] and a.status is SequenceStatus.FINISHED_ABORTED
    assert sorted(kit.names(out.scheduled)) == ["B", "C"]  # admitted in order, up to the cap
    assert [q.attempt for q, _ in s.prompted] == ["D"]
    assert b.status is SequenceStatus.RUNNING and d.status is SequenceStatus.WAITING


def test_s27_forked_head_needs_block_and_slot(kit):
    s = kit.sched(num_blocks=6, num_state_slots=3)
    parent = kit.running(s, "P", 5, 1)  # history 6, processed 5: blocks [1, 2]
    kit.admit_prompted(s)
    child = s.fork(parent, "C")
    assert s.prompted[0] == (child, True)
    taken = s.states.allocate(1)  # no free state slot: the fork must wait
    out = _decode(s)
    assert s.prompted and child not in s.running and out.state_copies == []
    s.process_outputs(out, [3])
    s.states.free(taken)
    out = _decode(s)
    assert child in s.running and out.state_copies == [(parent.state_slot, child.state_slot)]


def test_s28_candidates_from_short_end_victims_from_long_end(kit):
    # The chapter's pool: 19 usable blocks, all owned; B and C need one more block.
    s = kit.sched(num_blocks=20, num_state_slots=8, stop_preempted_request=True)
    a = kit.running(s, "A", 12, 8, processed=19)
    b = kit.running(s, "B", 43, 2, processed=44)
    c = kit.running(s, "C", 9, 4, processed=12)
    assert s.blocks.num_free == 0
    out = _decode(s)
    assert out.preempted == [a] and s.num_preemptions == 1
    assert [r.attempt for r in out.scheduled] == [b.attempt, c.attempt]
    assert (len(b.block_table), len(c.block_table)) == (12, 4)
    assert s.blocks.free_ids == [3, 2, 1]  # A's five freed last-first, two taken


def test_s28_room_in_table_still_needs_a_free_block(kit):
    s = kit.sched(num_blocks=4, stop_preempted_request=True)
    a = kit.running(s, "A", 5, 1)  # history 6, processed 5: 2 blocks hold 8 positions
    s.blocks.allocate(s.blocks.num_free)
    assert len(a.block_table) >= s.blocks_needed(a)
    out = _decode(s)
    assert out.scheduled == [] and out.preempted == [a]  # the candidate preempts itself
    assert a.status is SequenceStatus.FINISHED_PREEMPTED


def test_s28_append_slot_grows_by_one_and_trims_surplus(kit):
    s = kit.sched()
    a = kit.running(s, "A", 8, 1)  # history 9, processed 8: the next row is position 8
    kit.admit_prompted(s)
    assert len(a.block_table) == 2
    out = _decode(s)
    assert len(a.block_table) == 3 and a.in_flight == 1  # one block for position 8
    s.process_outputs(out, [5])
    extra = s.blocks.allocate(2)
    a.block_table += extra  # longer than needed (as after rejected draft positions)
    _decode(s)
    assert len(a.block_table) == 3 == s._ceil_blocks(len(a))
    assert set(extra) <= set(s.blocks.free_ids)


def test_s28_output_order_ties_keep_arrival(kit):
    s = kit.sched()
    seqs = [kit.running(s, n, 4, k) for n, k in (("A", 1), ("B", 3), ("C", 1), ("D", 3))]
    assert [q.attempt for q in sorted(reversed(seqs), key=decode_priority)] == ["B", "D", "A", "C"]


def test_s29_batch_sorted_by_history_longest_first(kit):
    s = kit.sched()
    for name, prompt, out_len in (("A", 4, 9), ("B", 30, 1), ("C", 10, 3)):
        kit.running(s, name, prompt, out_len)
    out = _decode(s)
    assert kit.rows(out) == [("B", 1, 31), ("C", 1, 13), ("A", 1, 13)]
    assert out.num_batched_tokens == 3 and all(r.sample for r in out.scheduled)
    assert kit.names(s.running) == ["B", "C", "A"]
