"""Speculative decoding in the scheduler: a draft's positions are a decode row's (S4's
draft_len counts them in its blocks, S36's seqlen_k ends past them); a row that emits
several tokens appends them in order under the stop rules; a draft never costs a
preemption; recompute clears it (Listing 5.10)."""

from __future__ import annotations

from pdserve.scheduler import SequenceStatus

ST = SequenceStatus


def _draft(seq, tokens):
    seq.draft_token_ids, seq.draft_len = list(tokens), len(tokens)


def test_a_drafted_row_computes_its_last_token_and_each_drafted_one(kit):
    s = kit.sched(num_blocks=64)
    a = kit.running(s, "A", 10, 2)  # history 12, processed 11
    kit.admit_prompted(s)
    _draft(a, [5, 6, 7])
    out = s.schedule()
    assert kit.rows(out) == [("A", 4, 15)]  # positions 11..14: the last token + 3 drafted
    assert out.scheduled[0].start_pos == 11 and a.in_flight == 4
    assert len(a.block_table) * 4 >= 15 and out.num_batched_tokens == 4  # S4
    # two drafted tokens accepted, then the token drawn after them
    res = s.process_outputs(out, [[5, 6, 9]])
    assert a.token_ids[-3:] == [5, 6, 9] and a.processed == 14 and a.in_flight == 0
    assert res.updated == [a, a, a]


def test_stop_rules_end_a_drafted_row_at_the_first_token_that_stops(kit):
    s = kit.sched(num_blocks=64)
    a = kit.running(s, "A", 10, 2)
    kit.admit_prompted(s)
    _draft(a, [5, kit.EOS, 8])
    out = s.schedule()
    res = s.process_outputs(out, [[5, kit.EOS, 8, 3]])
    assert a.token_ids[-2:] == [5, kit.EOS] and a.status is ST.FINISHED_STOPPED
    assert res.finished == [a] and a.block_table == []


def test_max_tokens_caps_the_tokens_a_drafted_row_emits(kit):
    s = kit.sched(num_blocks=64)
    a = kit.seq("A", 10, 2, max_tokens=4)
    a.processed = len(a) - 1
    s.add_prefilled(a)
    kit.admit_prompted(s)
    _draft(a, [5, 6, 7])
    out = s.schedule()
    s.process_outputs(out, [[5, 6, 7, 8]])
    assert a.output_len == 4 and a.token_ids[-2:] == [5, 6]
    assert a.status is ST.FINISHED_LENGTH_CAPPED


def test_a_draft_never_takes_a_block_another_sequence_needs(kit):
    """One block is free and two sequences decode: A (visited first: the longest output)
    may draft only into the room its own blocks hold, B's draft is dropped (its blocks
    are full), and nobody is preempted."""
    s = kit.sched(num_blocks=9)
    a = kit.running(s, "A", 8, 3)  # history 11: its 3 blocks hold 12 positions
    b = kit.running(s, "B", 15, 1)  # history 16: its 4 blocks are full
    kit.admit_prompted(s)
    assert s.blocks.num_free == 1
    _draft(a, [1, 2, 3])
    _draft(b, [4, 5, 6])
    out = s.schedule()
    assert out.preempted == [] and s.num_preemptions == 0
    assert sorted(kit.rows(out)) == [("A", 2, 12), ("B", 1, 16)]
    assert a.draft_token_ids == [1] and b.draft_len == 0


def test_a_draft_takes_free_blocks_when_there_are_more_than_enough(kit):
    s = kit.sched(num_blocks=64, block_size=4)
    a = kit.running(s, "A", 10, 2)  # history 12: 3 full blocks
    kit.admit_prompted(s)
    _draft(a, [1, 2, 3, 4, 5, 6])  # positions 12..17: two more blocks
    out = s.schedule()
    assert kit.rows(out) == [("A", 7, 18)] and len(a.block_table) == 5


def test_recompute_clears_the_draft(kit):
    s = kit.sched(num_blocks=8, stop_preempted_request=False)
    a = kit.running(s, "A", 8, 4)
    _draft(a, [1, 2])
    a.reset_for_recompute()
    assert a.draft_len == 0 and a.draft_token_ids == [] and a.processed == 0


def test_a_draft_set_by_the_scheduler_lives_one_step_scheduled_or_not(kit):
    """set_drafts: the speculator's drafts go through the scheduler, which drops them
    once the step is processed, for a drafted row and for a sequence its step left out."""
    s = kit.sched(num_blocks=64)
    a = kit.running(s, "A", 10, 2)
    b = kit.running(s, "B", 10, 2)
    kit.admit_prompted(s)
    s.set_drafts([(a, [5, 6])])
    out = s.schedule()
    assert ("A", 3, 14) in kit.rows(out)
    s.set_drafts([(b, [7])])  # drafted after the step was built: never scheduled
    s.process_outputs(out, [[5, 9] if r.attempt == "A" else 4 for r in out.scheduled])
    assert (a.draft_len, a.draft_token_ids, b.draft_len, b.draft_token_ids) == (0, [], 0, [])
    assert a.token_ids[-2:] == [5, 9]
    out = s.schedule()
    assert all(r.query_len == 1 for r in out.scheduled)  # no draft left
