"""The data-parallel group's collectives (S9, S10 and the chunk sizer's budget), for
ranks that all run on one thread.

In a real pool every rank blocks in ``all_reduce_min`` until its peers arrive. Here
the ranks' ``Scheduler.schedule()`` calls run one after the other, so a rank that
needs an answer its peers have not given yet is stopped (``VoteDeferred``) and its
``schedule()`` run again, from the start, once the answer is known. That is sound
because of where the scheduler takes its votes: the first vote and the budget come
before a step changes anything, and the second vote can only be waited on by a rank
whose value is 1, i.e. whose prefill pass selected and ignored nothing (S25) and so
changed nothing either. A value of 0 never waits: votes and budgets are >= 0, so the
group's minimum is 0 whatever the others say. The scheduler's own vote code runs
unchanged; only the collective is ours.
"""

from __future__ import annotations


class VoteDeferred(Exception):
    """This rank's step needs a group answer not known yet: run it again later."""


class GroupVotes:
    """One step's collectives of a group of ``world_size`` ranks: the k-th call of
    every rank's step is the same collective (as in a real group)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.answers: list[int | None] = []
        self.values: list[dict[int, int]] = []  # k -> rank -> value given
        self.settled_early = False

    def begin_step(self) -> None:
        self.answers.clear()
        self.values.clear()

    def _grow(self, k: int) -> None:
        while len(self.answers) <= k:
            self.answers.append(None)
            self.values.append({})

    def reduce(self, k: int, rank: int, value: int) -> int:
        self._grow(k)
        answer = self.answers[k]
        if answer is not None:
            return answer
        if value <= 0:  # the minimum is known already
            self.answers[k] = 0
            self.settled_early = True
            return 0
        self.values[k][rank] = value
        raise VoteDeferred

    def settle(self) -> bool:
        """Answer every collective all ranks have given a value to; True if any."""
        settled, self.settled_early = self.settled_early, False
        for k, values in enumerate(self.values):
            if self.answers[k] is None and len(values) == self.world_size:
                self.answers[k] = min(values.values())
                settled = True
        return settled


class GroupCommunicator:
    """One rank's ``Communicator`` (scheduler/votes.py) over a ``GroupVotes``."""

    def __init__(self, votes: GroupVotes, rank: int) -> None:
        self.votes = votes
        self.rank = rank
        self.world_size = votes.world_size
        self.calls = 0  # collectives this rank's current try of its step has made

    def all_reduce_min(self, value: int) -> int:
        k = self.calls
        self.calls += 1
        return self.votes.reduce(k, self.rank, int(value))


def schedule_group(ranks: list, votes: GroupVotes) -> list:
    """Every rank's ``schedule()`` for one lockstep step, each collective answered with
    the group's minimum; the outputs in rank order."""
    votes.begin_step()
    outputs: list = [None] * len(ranks)
    pending = list(range(len(ranks)))
    while pending:
        blocked = []
        for i in pending:
            comm = ranks[i].comm
            comm.calls = 0
            try:
                outputs[i] = ranks[i].scheduler.schedule()
            except VoteDeferred:
                blocked.append(i)
        if blocked and not votes.settle():
            raise RuntimeError(f"the group's votes did not settle ({len(blocked)} ranks wait)")
        pending = blocked
    return outputs
