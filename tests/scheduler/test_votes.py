"""Section 4: choosing the kind of step, single rank and an in-process group (S6-S11)."""

from __future__ import annotations

import random

import pytest

from pdserve.scheduler import EngineType, StepKind
from pdserve.scheduler.votes import Communicator, SingleRankCommunicator


def test_communicator_protocol():
    c = SingleRankCommunicator()
    assert isinstance(c, Communicator)
    assert (c.rank, c.world_size, c.all_reduce_min(5)) == (0, 1, 5)


def test_s06_prompt_engine_always_prefills_completion_always_decodes(kit):
    p = kit.sched(EngineType.PROMPT)
    p.decode_step = 5  # no attempt point: a NORMAL engine would decode
    assert p.schedule().kind is StepKind.PROMPT  # even an empty result is a prompt step
    p.add(kit.seq("A", 8))
    p.decode_step = 5
    out = p.schedule()
    assert out.kind is StepKind.PROMPT and kit.names(out.scheduled) == ["A"]

    c = kit.sched(EngineType.COMPLETION)
    kit.running(c, "B", 8, 1)
    kinds = {c.schedule().kind for _ in range(150)}  # crosses every ALL and ANY point
    assert kinds == {StepKind.DECODE}
    with pytest.raises(RuntimeError):
        c.add(kit.seq("C", 4))


def test_s07_any_and_all_points(kit, recording_comm):
    # The head is not schedulable: every vote is "don't want", and the step decodes.
    s = kit.sched(comm=recording_comm, prefill_attempt_interval=3, prefill_any_attempt_interval=5)
    blocked = kit.seq("X", 4)
    blocked.schedulable = False
    s.add(blocked)
    votes = {}
    for _ in range(16):
        step = s.decode_step
        before = len(recording_comm.values)
        assert s.schedule().kind is StepKind.DECODE
        votes[step] = recording_comm.values[before:]
    # Not wanting reduces 1 at an ANY point and 0 at an ALL point.
    expected = {0: [0], 3: [0], 5: [1], 6: [0], 9: [0], 10: [1], 12: [0], 15: [1]}
    assert {k: v for k, v in votes.items() if v} == expected  # 15: both coincide -> ANY
    assert s.decode_step == 16


def test_s08_wants_prefill_watermark_and_head_only(kit):
    s = kit.sched(num_blocks=20)
    s.blocks.allocate(18)  # usage 18/20 = 0.9: at the watermark still wants
    s.add(kit.seq("D", 4))
    assert s.schedule().kind is StepKind.PROMPT

    s = kit.sched(num_blocks=20)
    s.blocks.allocate(18)
    s.add(kit.seq("D", 1))
    s.blocks.allocate(1)  # 19/20 = 0.95 > 0.9
    out = s.schedule()
    assert out.kind is StepKind.DECODE and kit.names(s.waiting) == ["D"]

    s = kit.sched()
    head, second = kit.seq("X", 4), kit.seq("Y", 4)
    head.schedulable = False
    s.add(head)
    s.add(second)
    assert s.schedule().kind is StepKind.DECODE  # only the head is looked at
    assert kit.names(s.waiting) == ["X", "Y"]


def _group_step(thread_group, scheds):
    group = thread_group(len(scheds))
    for rank, s in enumerate(scheds):
        s.comm = group.communicator(rank)
    return group.run(lambda rank: scheds[rank].schedule()), group


@pytest.mark.parametrize("point,step", [("ANY", 100), ("ALL", 70)])
def test_s09_any_point_needs_one_wish_all_point_needs_every_wish(kit, thread_group, point, step):
    eager, idle = kit.sched(), kit.sched()
    eager.add(kit.seq("A", 8))
    for s in (eager, idle):
        s.decode_step = step
    outs, group = _group_step(thread_group, [eager, idle])
    if point == "ANY":
        assert [o.kind for o in outs] == [StepKind.PROMPT, StepKind.EMPTY_PROMPT]
        assert kit.names(outs[0].scheduled) == ["A"] and outs[1].scheduled == []
        assert group.calls == [2, 2]  # try vote, then result vote
    else:
        assert [o.kind for o in outs] == [StepKind.DECODE, StepKind.DECODE]
        assert kit.names(eager.waiting) == ["A"]
        assert group.calls == [1, 1]


def test_s09_single_rank_result_is_own_wish(kit):
    for step in (70, 100):
        s = kit.sched()
        s.add(kit.seq("A", 8))
        s.decode_step = step
        assert s.schedule().kind is StepKind.PROMPT
        s = kit.sched()
        s.decode_step = step
        assert s.schedule().kind is StepKind.DECODE


def test_s10_second_vote_empty_prompt_step_or_everyone_decodes(kit, thread_group):
    # Rank 0 wants but its head cannot fit now (LATER); rank 1 wants and fits.
    stuck, ok = kit.sched(num_blocks=8), kit.sched(num_blocks=8)
    stuck.blocks.allocate(3)  # 4 free, usage 3/8 <= 0.9
    stuck.add(kit.seq("big", 20))  # needs 5 blocks: LATER
    ok.add(kit.seq("small", 4))
    outs, group = _group_step(thread_group, [stuck, ok])
    assert [o.kind for o in outs] == [StepKind.EMPTY_PROMPT, StepKind.PROMPT]
    assert stuck.decode_step == ok.decode_step == 0

    # Both want and neither produces a result: both decode, the counter advances.
    a, b = kit.sched(num_blocks=8), kit.sched(num_blocks=8)
    for s in (a, b):
        s.blocks.allocate(3)
        s.add(kit.seq("big", 20))
    outs, group = _group_step(thread_group, [a, b])
    assert [o.kind for o in outs] == [StepKind.DECODE, StepKind.DECODE]
    assert a.decode_step == b.decode_step == 1
    assert group.calls == [2, 2]


def test_s10_single_rank_no_result_decodes(kit):
    s = kit.sched(num_blocks=8)
    s.blocks.allocate(3)
    s.add(kit.seq("big", 20))
    out = s.schedule()
    assert out.kind is StepKind.DECODE and s.decode_step == 1


def test_s11_counter_after_prompt_and_decode_steps(kit):
    s = kit.sched(prefill_attempt_interval=4, prefill_any_attempt_interval=6)
    out, _ = kit.step(s)  # step 0 is an ALL point: nothing waits, it decodes
    assert out.kind is StepKind.DECODE and s.decode_step == 1
    s.add(kit.seq("A", 8))
    for expected in (2, 3, 4):  # no attempt until decode_step reaches 4
        out, _ = kit.step(s)
        assert out.kind is StepKind.DECODE and s.decode_step == expected
    assert kit.names(s.waiting) == ["A"]
    out, _ = kit.step(s)
    assert out.kind is StepKind.PROMPT and s.decode_step == 0
    s.add(kit.seq("B", 4))
    out, _ = kit.step(s)  # after a prompt step the next call is an ALL point again
    assert out.kind is StepKind.PROMPT and kit.names(out.scheduled) == ["B"]
    out = s.schedule()
    assert out.kind is StepKind.DECODE and s.decode_step == 1
    assert kit.names(s.running) == [r.attempt for r in out.scheduled] == ["A", "B"]


def test_votes_stay_in_lockstep_under_divergent_load(kit, thread_group):
    """Every rank calls the collective equally often and runs the same kind of step."""
    world, steps = 3, 300
    rngs = [random.Random(rank) for rank in range(world)]
    scheds = [kit.sched(num_blocks=40, max_num_seqs=8, max_num_batched_tokens=16,
                        prefill_attempt_interval=3, prefill_any_attempt_interval=5)
              for _ in range(world)]
    group = thread_group(world)
    for rank, s in enumerate(scheds):
        s.comm = group.communicator(rank)
    counter = [0] * world

    def one_step(rank):
        s, rng = scheds[rank], rngs[rank]
        if rng.random() < 0.1 * (rank + 1):
            counter[rank] += 1
            s.add(kit.seq(f"r{rank}-{counter[rank]}", rng.randint(1, 40),
                          max_tokens=rng.randint(1, 12)))
        out = s.schedule()
        s.process_outputs(out, [3 if r.sample else None for r in out.scheduled])
        return out.kind

    for _ in range(steps):
        kinds = group.run(one_step)
        prompt_like = {k in (StepKind.PROMPT, StepKind.EMPTY_PROMPT) for k in kinds}
        assert len(prompt_like) == 1, kinds
        assert len({s.decode_step for s in scheds}) == 1
    assert len(set(group.calls)) == 1 and group.calls[0] > 0
