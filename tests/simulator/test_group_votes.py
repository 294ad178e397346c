"""The one-thread group collectives give every rank the decisions a real group (one
thread per rank, blocking all-reduces) gives."""

import threading

from pdserve.scheduler import EngineType, SamplingParams, Scheduler, SchedulerConfig, Sequence
from pdserve.simulator.group_votes import GroupCommunicator, GroupVotes, schedule_group


class BarrierComm:
    def __init__(self, shared, rank, world):
        self.shared, self.rank, self.world_size = shared, rank, world

    def all_reduce_min(self, value):
        barrier, slots = self.shared
        slots[self.rank] = value
        barrier.wait()
        out = min(slots)
        barrier.wait()
        return out


def config():
    return SchedulerConfig(block_size=4, num_blocks=40, num_state_slots=9, max_model_len=64,
                           max_num_seqs=4, max_num_batched_tokens=16, chunked_prefill=True,
                           prefill_attempt_interval=3, prefill_any_attempt_interval=2,
                           enable_prefix_caching=False)


# (step, rank, prompt length, max_tokens): ranks get work at different steps so that
# ANY points with one wish and ALL points with one refusal both occur.
ARRIVALS = [(0, 0, 10, 6), (1, 1, 5, 3), (4, 1, 20, 5), (5, 0, 3, 8), (9, 0, 12, 2),
            (9, 1, 7, 9), (14, 1, 30, 4)]
STEPS = 40


def drive(step_all):
    """Lockstep steps of two NORMAL schedulers; what each scheduled, per step."""
    trace = []
    for step in range(STEPS):
        for s, r, n, m in ARRIVALS:
            if s == step:
                seq = Sequence(f"{r}-{step}", list(range(1, n + 1)), SamplingParams(max_tokens=m),
                               arrival_time=float(step))
                step_all.schedulers[r].add(seq)
        outs = step_all()
        for sched, out in zip(step_all.schedulers, outs, strict=True):
            sched.process_outputs(out, [5] * len(out.scheduled))
        trace.append([(o.kind.name, [(row.attempt, row.query_len) for row in o.scheduled])
                      for o in outs])
    return trace


def threaded():
    shared = (threading.Barrier(2), [0, 0])
    scheds = [Scheduler(config(), EngineType.NORMAL, BarrierComm(shared, r, 2)) for r in (0, 1)]

    def step_all():
        outs = [None, None]

        def one(r):
            outs[r] = scheds[r].schedule()

        threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return outs

    step_all.schedulers = scheds
    return step_all


def one_thread():
    votes = GroupVotes(2)

    class R:
        def __init__(self, r):
            self.comm = GroupCommunicator(votes, r)
            self.scheduler = Scheduler(config(), EngineType.NORMAL, self.comm)

    ranks = [R(0), R(1)]

    def step_all():
        return schedule_group(ranks, votes)

    step_all.schedulers = [r.scheduler for r in ranks]
    return step_all


def test_one_thread_votes_match_a_real_group():
    expected = drive(threaded())
    got = drive(one_thread())
    assert got == expected
    kinds = {k for step in expected for k, _ in step}
    assert {"PROMPT", "EMPTY_PROMPT", "DECODE"} <= kinds  # the trace exercises S9-S10
