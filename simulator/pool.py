"""A pool's data-parallel ranks stepping in lockstep on virtual time.

As ``engine/engine_loop.py``: each turn the pool steps if any rank has work (an idle
rank takes an empty step) and parks when none has; new work wakes it. A step lasts
as long as its slowest rank's (the group's next collective waits for it). Ranks of a
group that votes (NORMAL engines, or a chunk sizer's budget) all run ``schedule()``
through ``group_votes``; otherwise a rank with nothing to do is left out of the step,
since an empty PROMPT or COMPLETION step changes nothing but its counters (counted).
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.scheduler.config import EngineType, SchedulerConfig
from pdserve.scheduler.output import SchedulerOutput, StepResult
from pdserve.simulator.clock import Clock
from pdserve.simulator.cost_model import CostModel
from pdserve.simulator.group_votes import GroupCommunicator, GroupVotes, schedule_group
from pdserve.simulator.rank import SimRank

# (pool, rank, its step's output, what processing it gave, the step's end time)
StepHandler = Callable[["SimPool", SimRank, SchedulerOutput, StepResult, float], None]


class SimPool:
    def __init__(self, name: str, num_ranks: int, config: SchedulerConfig,
                 engine_type: EngineType, costs: CostModel, clock: Clock,
                 on_rank_step: StepHandler, first_uid: int = 0) -> None:
        self.name = name
        self.clock = clock
        self.costs = costs
        self.on_rank_step = on_rank_step
        self.votes_each_step = engine_type == EngineType.NORMAL or (
            config.chunk_time_budget_s is not None)
        self.votes = GroupVotes(num_ranks) if self.votes_each_step and num_ranks > 1 else None
        self.ranks = [
            SimRank(first_uid + i, i, config, engine_type, costs,
                    GroupCommunicator(self.votes, i) if self.votes else None)
            for i in range(num_ranks)]
        self.busy: set[int] = set()  # ranks that may have work (index in ranks)
        self.stepping = False
        self.num_steps = 0
        self.step_log: list[tuple] | None = None  # (start, end, kind, rows, tokens) per rank step
        # Called with a rank whose schedule() preempted (its free blocks grew mid-step).
        self.on_preempted: Callable[[SimRank], None] | None = None

    def wake(self, rank: SimRank) -> None:
        """New work on ``rank``: a parked pool steps now."""
        self.busy.add(rank.rank)
        if not self.stepping:
            self.stepping = True
            self.clock.at(self.clock.now, self._start_step)

    def _start_step(self) -> None:
        now = self.clock.now
        ranks = self.ranks
        if self.votes_each_step:
            if not any(r.has_work() for r in ranks):
                self.stepping = False
                self.busy.clear()
                return
            stepping = ranks
            for r in stepping:
                r.admit()
            if self.votes is not None:
                outputs = schedule_group(stepping, self.votes)
            else:
                outputs = [r.scheduler.schedule() for r in stepping]
        else:
            stepping = [ranks[i] for i in sorted(self.busy) if ranks[i].has_work()]
            if not stepping:
                self.stepping = False
                self.busy.clear()
                return
            outputs = []
            for r in stepping:
                r.admit()
                out = r.scheduler.schedule()
                if out.preempted and self.on_preempted is not None:
                    self.on_preempted(r)
                outputs.append(out)
        # A step where no rank computes anything still costs a step's fixed part (the
        # engine spins, e.g. while a head waits for blocks held by the others).
        seconds = max(r.step_seconds(out) for r, out in zip(stepping, outputs, strict=True)) \
            or self.costs.decode.a
        self.num_steps += 1
        self.clock.at(now + seconds, self._end_step, stepping, outputs, now)

    def _end_step(self, stepping: list[SimRank], outputs: list[SchedulerOutput],
                  started: float) -> None:
        now = self.clock.now
        log = self.step_log
        busy = self.busy
        for r, out in zip(stepping, outputs, strict=True):
            result = r.finish_step(out)
            if log is not None:
                log.append((self.name, r.rank, out.kind.name.lower(), started, now,
                            out.num_tokens, len(out.scheduled)))
            self.on_rank_step(self, r, out, result, now)
            if not r.has_work():
                busy.discard(r.rank)
        self._start_step()
