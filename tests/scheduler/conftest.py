"""Small builders shared by the scheduler tests (exposed as fixtures; see `kit`)."""

from __future__ import annotations

import threading

import pytest

from pdserve.scheduler import (
    EngineType,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)


class Kit:
    """Builders for configs, sequences and schedulers in known states."""

    EOS = 0

    @staticmethod
    def config(**kw) -> SchedulerConfig:
        base = dict(block_size=4, num_blocks=64, num_state_slots=16, max_model_len=256,
                    max_num_seqs=16, max_num_batched_tokens=256, chunked_prefill=True,
                    enable_prefix_caching=False)  # the rules S1-S37 as the spec writes them
        base.update(kw)
        return SchedulerConfig(**base)

    @classmethod
    def sched(cls, engine=EngineType.NORMAL, comm=None, **kw) -> Scheduler:
        if engine == EngineType.COMPLETION:
            kw.setdefault("stop_preempted_request", True)
        return Scheduler(cls.config(**kw), engine, comm)

    @classmethod
    def seq(cls, name, prompt_len, output_len=0, max_tokens=1000, **sampling) -> Sequence:
        s = Sequence(name, [1 + i % 50 for i in range(prompt_len)],
                     SamplingParams(max_tokens=max_tokens, **sampling), eos_token_id=cls.EOS)
        s.token_ids.extend(100 + i for i in range(output_len))
        return s

    @classmethod
    def running(cls, sched: Scheduler, name, prompt_len, output_len, processed=None) -> Sequence:
        """A decoding sequence owning ceil(processed / block_size) blocks, admitted to
        running through the import path (it joins running on the next decode pass)."""
        s = cls.seq(name, prompt_len, output_len)
        s.processed = len(s) - 1 if processed is None else processed
        sched.add_prefilled(s)
        return s

    @staticmethod
    def admit_prompted(sched: Scheduler) -> None:
        """Move prompted sequences into running without scheduling anyone (S27 only)."""
        from pdserve.scheduler.output import SchedulerOutput, StepKind
        sched._admit_prompted(SchedulerOutput(StepKind.DECODE))

    @staticmethod
    def step(sched: Scheduler, token: int = 7):
        """One engine step: schedule, then sample `token` for every row that samples."""
        out = sched.schedule()
        res = sched.process_outputs(out, [token if r.sample else None for r in out.scheduled])
        return out, res

    @staticmethod
    def names(seqs) -> list[str]:
        return [s.attempt for s in seqs]

    @staticmethod
    def rows(out) -> list[tuple[str, int, int]]:
        return [(r.attempt, r.query_len, r.seqlen_k) for r in out.scheduled]


class ThreadGroup:
    """An in-process data-parallel group: ranks are threads, all_reduce_min a barrier."""

    def __init__(self, world_size: int, timeout: float = 10.0) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._values = [0] * world_size
        self.calls = [0] * world_size

    def communicator(self, rank: int) -> _ThreadComm:
        return _ThreadComm(self, rank)

    def run(self, fn) -> list:
        """fn(rank) on every rank at once; returns the results in rank order."""
        results: list = [None] * self.world_size
        errors: list = []

        def body(rank):
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # surface in the main thread
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class _ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def all_reduce_min(self, value: int) -> int:
        g = self.group
        g.calls[self.rank] += 1
        g._values[self.rank] = value
        g._barrier.wait()
        result = min(g._values)
        g._barrier.wait()  # nobody overwrites a value before everyone has read
        return result


class RecordingComm:
    """One rank that records every vote value it is asked to reduce."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.values: list[int] = []

    def all_reduce_min(self, value: int) -> int:
        self.values.append(value)
        return value


@pytest.fixture
def kit() -> type[Kit]:
    return Kit


@pytest.fixture
def thread_group():
    return ThreadGroup


@pytest.fixture
def recording_comm():
    return RecordingComm()


__all__ = ["Kit", "ThreadGroup", "RecordingComm", "SequenceStatus"]
