"""Section 7: preemption, recompute, outputs, abort, forks, freeing (S30-S35)."""

from __future__ import annotations

import random

import pytest

from pdserve.scheduler import AllocStatus, EngineType, SequenceStatus, StepKind

ST = SequenceStatus


def _full_pool(kit, **kw):
    """A holds 3 blocks, B 4: the 7 usable blocks are all owned; B needs no new block
    but there is no free one, so A (longest output) is the victim."""
    s = kit.sched(num_blocks=8, **kw)
    a = kit.running(s, "A", 8, 4)  # history 12, processed 11
    b = kit.running(s, "B", 15, 1)  # history 16, processed 15
    assert s.blocks.num_free == 0
    s.decode_step = 1
    return s, a, b


@pytest.mark.parametrize("stop,so,recompute", [
    (False, 0, True), (True, 0, False), (False, 1, False), (False, -1, False),
])
def test_s30_preempt_recompute_or_terminate(kit, stop, so, recompute):
    s, a, b = _full_pool(kit, stop_preempted_request=stop)
    a.so_status = so
    s.add(kit.seq("D", 4))
    out = s.schedule()
    assert out.preempted == [a] and out.num_preempted == 1 and s.num_preemptions == 1
    assert a.block_table == [] and a.state_slot == -1 and s.blocks.num_free == 3
    assert len(a) == 12 and a.sampling.max_tokens == 1000  # history and settings kept
    if recompute:
        assert a.status is ST.WAITING and a.processed == 0 and a.in_flight == 0
        assert kit.names(s.waiting) == ["A", "D"] and out.ignored == []
    else:
        assert a.status is ST.FINISHED_PREEMPTED and a.processed == 11
        assert a.finish_reason == "insufficient_system_resource"
        assert kit.names(s.waiting) == ["D"] and out.ignored == [a]
        assert a in s.process_outputs(out, [1]).finished


def test_s31_recompute_prefills_whole_history_and_continues(kit):
    s, a, b = _full_pool(kit, stop_preempted_request=False, prefill_attempt_interval=1)
    b.sampling = type(b.sampling)(max_tokens=2)  # B finishes after this step
    out, res = kit.step(s, token=42)
    assert out.preempted == [a] and res.finished == [b]
    out, res = kit.step(s, token=43)
    assert out.kind is StepKind.PROMPT
    assert kit.rows(out) == [("A", 12, 12)]  # all 12 positions: prompt + 4 outputs
    assert a.output_len == 5 and a.token_ids[-1] == 43 and a.processed == 12
    assert a.output_token_ids[:4] == [100, 101, 102, 103]  # the answer continues
    assert a.first_token_time is None  # its first token came before this engine saw it


def test_s32_stale_decode_output_of_preempted_sequence_is_skipped(kit):
    s = kit.sched(num_blocks=5, stop_preempted_request=False)
    a = kit.running(s, "A", 4, 3)  # history 7, processed 6: 2 blocks
    b = kit.running(s, "B", 3, 1)  # history 4, processed 3: 1 block
    s.decode_step = 1
    out1 = s.schedule()  # both in flight; 1 block free
    assert kit.names(out1.scheduled) == ["A", "B"] and a.in_flight == 1
    out2 = s.schedule()  # overlapped: B's next row needs the last block, A is preempted
    assert out2.preempted == [a] and a.status is ST.WAITING and a.in_flight == 0
    res = s.process_outputs(out1, [5, 6])
    assert a.processed == 0 and len(a) == 7 and list(s.waiting).count(a) == 1
    assert res.updated == [b] and b.processed == 4 and b.in_flight == 1
    s.process_outputs(out2, [8])
    assert b.token_ids[-2:] == [6, 8] and b.processed == 5


@pytest.mark.parametrize("token,kw,max_model_len,expected", [
    (0, {}, 256, ST.FINISHED_STOPPED),  # eos
    (0, {"ignore_eos": True}, 256, ST.RUNNING),
    (9, {"stop_token_ids": [9]}, 256, ST.FINISHED_STOPPED),
    (5, {"max_tokens": 2}, 256, ST.FINISHED_LENGTH_CAPPED),
    (5, {}, 6, ST.FINISHED_LENGTH_CAPPED),  # history 7 > max_model_len 6
    (5, {}, 7, ST.RUNNING),  # history 7 == max_model_len is allowed
    (0, {"max_tokens": 2}, 256, ST.FINISHED_STOPPED),  # eos is checked first
])
def test_s32_stop_rules(kit, token, kw, max_model_len, expected):
    s = kit.sched(max_model_len=max_model_len)
    a = kit.seq("A", 5, max_tokens=kw.pop("max_tokens", 1000), **kw)
    s.add(a)
    out, res = kit.step(s)  # prompt step: first token 7
    assert a.status is ST.RUNNING and a.first_token_time is not None and res.updated == [a]
    first = a.first_token_time
    s.decode_step = 1
    out = s.schedule()
    res = s.process_outputs(out, [token])
    assert a.status is expected and a.token_ids[-1] == token and a.first_token_time == first
    assert (a in res.finished) == expected.is_finished
    if expected.is_finished:
        assert a.block_table == [] and a.finish_reason in ("stop", "length")


def test_s32_structured_output_failure_and_partial_prompt_front(kit):
    s = kit.sched(max_num_batched_tokens=16, max_num_seqs=8)
    a, b = kit.seq("A", 20), kit.seq("B", 4)
    s.add(a)
    s.add(b)
    out, res = kit.step(s)
    assert kit.rows(out) == [("A", 16, 16)] and res.updated == []
    assert list(s.waiting) == [a, b] and a.status is ST.WAITING  # back at the FRONT
    a.so_status = -1
    out, res = kit.step(s)
    assert kit.rows(out) == [("A", 4, 20), ("B", 4, 4)]
    assert a.status is ST.FINISHED_SO_FAILED and a.finish_reason == "structured_output_failed"
    assert res.finished == [a] and res.updated == [a, b]


def test_s33_abort_marks_then_next_pass_sweeps_once(kit):
    s = kit.sched(max_num_batched_tokens=16, max_num_seqs=8)
    r = kit.running(s, "R", 4, 1)
    kit.admit_prompted(s)
    w = kit.seq("W", 4)
    inflight = kit.seq("F", 30)
    s.add(inflight)
    s.add(w)
    out = s.schedule()  # F's first chunk is in flight, in no queue
    assert kit.names(out.scheduled) == ["F"]
    for name in ("R", "W", "F"):
        assert s.abort(name)
    assert not s.abort("F") and not s.abort("nope")
    assert r.block_table and r.status is ST.FINISHED_ABORTED  # marked, not yet freed
    res = s.process_outputs(out, [None])
    assert res.finished == [inflight] and inflight.block_table == []
    s.decode_step = 1
    out, res = kit.step(s)
    assert {q.attempt for q in res.finished} == {"R", "W"}
    assert not s.has_unfinished()
    out, res = kit.step(s)
    assert res.finished == [] and out.ignored == []
    s.assert_drained()


def test_s34_fork_pins_and_routes_child(kit):
    s = kit.sched(num_blocks=16)
    parent = kit.running(s, "P", 9, 1)  # history 10, processed 9: 3 blocks
    kit.admit_prompted(s)
    child = s.fork(parent, "C")
    assert child.token_ids == parent.token_ids and child.token_ids is not parent.token_ids
    assert all(s.blocks.refcount(b) == 2 for b in parent.block_table)
    assert s.states.refcount(parent.state_slot) == 2
    assert s.prompted[-1] == (child, True)
    s.decode_step = 1
    out = s.schedule()
    # Admission: blocks 0-1 full and shared, block 2 (position 8) copied, slot cloned.
    assert child.block_table[:2] == parent.block_table[:2]
    assert out.block_copies == [(parent.block_table[2], child.block_table[2])]
    assert out.state_copies == [(parent.state_slot, child.state_slot)]
    assert {r.attempt for r in out.scheduled} == {"P", "C"}
    tokens = {"P": 11, "C": 12}
    res = s.process_outputs(out, [tokens[r.attempt] for r in out.scheduled])
    assert set(res.updated) == {parent, child}
    assert (parent.token_ids[-1], child.token_ids[-1]) == (11, 12)  # they diverge freely
    assert parent.token_ids[:-1] == child.token_ids[:-1] and len(child) == 11

    t = kit.sched(max_num_batched_tokens=8, max_num_seqs=8)
    p2 = kit.seq("P2", 20)
    t.add(p2)
    kit.step(t)  # 8 of 20 cached
    c2 = t.fork(p2, "C2")
    assert t.waiting[0] is c2 and c2.processed == 8 and c2.fork_pending


def _random_trace(kit, seed, engine=EngineType.NORMAL, stop=False):
    rng = random.Random(seed)
    s = kit.sched(engine, num_blocks=16, num_state_slots=6, max_num_seqs=4,
                  max_num_batched_tokens=12, max_model_len=40, prefill_attempt_interval=2,
                  prefill_any_attempt_interval=3, stop_preempted_request=stop)
    live, n = [], 0
    finished_ids = []
    for _ in range(400):
        if rng.random() < 0.3 and engine != EngineType.COMPLETION:
            n += 1
            q = kit.seq(f"r{n}", rng.randint(1, 36), max_tokens=rng.randint(1, 10))
            if rng.random() < 0.2:
                q.checkpoints = [rng.randint(1, 12)]
            s.add(q)
            live.append(q)
        if rng.random() < 0.05 and live:
            s.abort(rng.choice(live).attempt)
        if rng.random() < 0.05:
            decoding = [q for q in s.running if not q.is_finished and not q.in_flight]
            if decoding:
                n += 1
                live.append(s.fork(rng.choice(decoding), f"f{n}"))
        out = s.schedule()
        res = s.process_outputs(out, [(0 if rng.random() < 0.05 else 3) if r.sample else None
                                      for r in out.scheduled])
        finished_ids += [q.attempt for q in res.finished]
        for q in res.handed_off:
            s.release_handed_off(q)
    for q in live:
        s.abort(q.attempt)
    for _ in range(5):
        out = s.schedule()
        res = s.process_outputs(out, [3 if r.sample else None for r in out.scheduled])
        finished_ids += [q.attempt for q in res.finished]
    return s, live, finished_ids


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stop", [False, True])
def test_s35_every_path_frees_exactly_once(kit, seed, stop):
    s, live, finished = _random_trace(kit, seed, stop=stop)
    assert not s.has_unfinished()
    s.assert_drained()
    assert s.num_free_blocks == 15
    assert len(finished) == len(set(finished)) == len(live)  # each reported once
    assert all(q.is_finished and q.block_table == [] and q.state_slot == -1 for q in live)
    if not stop:
        assert s.num_preemptions > 0  # the trace did exercise recompute


def test_s35_prompt_engine_hand_off_and_completion_import(kit):
    p = kit.sched(EngineType.PROMPT)
    a, one = kit.seq("A", 10), kit.seq("one", 3, max_tokens=1)
    p.add(a)
    p.add(one)
    out, res = kit.step(p, token=5)
    assert res.handed_off == [a] and res.finished == [one] and p.running == []
    assert a.block_table and a.state_slot > 0 and a.status is ST.RUNNING
    assert p.get_sequence("A") is None and not p.has_unfinished()
    with pytest.raises(AssertionError, match="blocks"):
        p.assert_drained()
    p.release_handed_off(a)
    p.assert_drained()

    c = kit.sched(EngineType.COMPLETION, num_blocks=5)  # 4 usable
    assert c.can_admit_prefilled(16) is AllocStatus.OK
    assert c.can_admit_prefilled(17) is AllocStatus.NEVER
    imported = kit.seq("A", 10)
    imported.token_ids.append(5)
    imported.processed = 10
    c.add_prefilled(imported)
    assert len(imported.block_table) == 3 and c.prompted[0] == (imported, False)
    assert imported.status is ST.WAITING
    assert c.can_admit_prefilled(5) is AllocStatus.LATER
    big = kit.seq("big", 8)
    big.processed = 8
    with pytest.raises(RuntimeError, match="LATER"):
        c.add_prefilled(big)
    out, res = kit.step(c, token=0)
    assert kit.rows(out) == [("A", 1, 11)] and res.finished == [imported]
    c.assert_drained()


@pytest.mark.parametrize("seed", range(3))
def test_s35_prompt_engine_random_trace_drains(kit, seed):
    s, live, finished = _random_trace(kit, seed, engine=EngineType.PROMPT, stop=True)
    assert not s.has_unfinished()
    s.assert_drained()
    assert len(finished) == len(set(finished))


def test_s33_abort_while_a_decode_row_is_in_flight(kit):
    s = kit.sched(EngineType.COMPLETION)
    a = kit.running(s, "A", 6, 1)
    out = s.schedule()
    table = list(a.block_table)
    assert s.abort("A")
    res = s.process_outputs(out, [5])  # the output arrives after the abort
    assert res.finished == [a] and res.updated == [] and len(a) == 7
    assert a.block_table == [] and a.in_flight == 0
    assert set(table) <= set(s.blocks.free_ids)
    out = s.schedule()  # the sweep finds it already retired: freed and reported once
    assert out.ignored == [] and s.process_outputs(out, []).finished == []
    s.assert_drained()


def test_api_misuse_is_refused(kit):
    s = kit.sched()
    a = kit.seq("A", 4)
    s.add(a)
    with pytest.raises(ValueError, match="already scheduled"):
        s.add(kit.seq("A", 4))
    out = s.schedule()
    with pytest.raises(ValueError, match="sampled tokens"):
        s.process_outputs(out, [])
    with pytest.raises(RuntimeError, match="cannot fork"):
        s.fork(a, "child")  # its prompt is still in flight
    s.process_outputs(out, [3])
    assert s.get_sequence("A") is a and s.get_sequence("B") is None


@pytest.mark.parametrize("so,recompute", [(1, True), (-1, False), (0, True)])
def test_section9_structured_output_recomputed_when_the_policy_is_on(kit, so, recompute):
    """Spec section 9: with recompute_structured_output, a preempted sequence with an
    active matcher (so_status 1) is recomputed like any other (its matcher kept by the
    engine); a failed one (-1) still ends. S30's default is tested above."""
    s, a, b = _full_pool(kit, stop_preempted_request=False, recompute_structured_output=True)
    a.so_status = so
    s.add(kit.seq("D", 4))
    out = s.schedule()
    assert out.preempted == [a]
    if recompute:
        assert a.status is ST.WAITING and a.so_status == so and out.ignored == []
    else:
        assert a.status is ST.FINISHED_PREEMPTED and out.ignored == [a]


def test_token_check_refusal_ends_the_sequence_structured_output_failed(kit):
    """The engine's matcher sees each token appended to a sequence with so_status 1;
    a refused token ends it with structured_output_failed (the token stays reported)."""
    s = kit.sched(max_num_batched_tokens=16, max_num_seqs=8)
    seen = []
    s.token_check = lambda seq, token: seen.append((seq.attempt, token)) or token != 7
    a, b = kit.seq("A", 4), kit.seq("B", 4)
    a.so_status = 1
    s.add(a)
    s.add(b)
    kit.step(s, token=5)
    assert seen == [("A", 5)] and a.status is ST.RUNNING  # B (so_status 0) unchecked
    kit.admit_prompted(s)
    out, res = kit.step(s, token=7)
    assert a.status is ST.FINISHED_SO_FAILED and a.finish_reason == "structured_output_failed"
    assert a in res.finished and b.status is ST.RUNNING and a.block_table == []
