"""What schedule() hands the engine and what process_outputs() hands back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.scheduler.sequence import Sequence


class StepKind(enum.Enum):
    PROMPT = 0
    DECODE = 1
    EMPTY_PROMPT = 2  # nothing local to prefill, but a peer rank prefills (S10)


@dataclass(slots=True)
class ScheduledSequence:
    """One row of a step: q query positions ending at seqlen_k (S36)."""

    seq: Sequence
    query_len: int
    seqlen_k: int
    sample: bool  # a token is sampled: the row completes the history, or it is a decode row

    @property
    def start_pos(self) -> int:
        return self.seqlen_k - self.query_len

    @property
    def positions(self) -> range:
        return range(self.seqlen_k - self.query_len, self.seqlen_k)


@dataclass
class SchedulerOutput:
    kind: StepKind
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    ignored: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0  # budget charged, cp_align padding included
    num_preempted: int = 0
    preempted: list[Sequence] = field(default_factory=list)  # in preemption order
    # Copy-on-write for forks, to run before the step writes: (src, dst) ids.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        """Useful query positions (without alignment padding)."""
        return sum(row.query_len for row in self.scheduled)


@dataclass
class StepResult:
    updated: list[Sequence] = field(default_factory=list)  # got a new token this step
    finished: list[Sequence] = field(default_factory=list)  # each finished sequence once
    handed_off: list[Sequence] = field(default_factory=list)  # PROMPT engine, still own blocks
    forked: list[Sequence] = field(default_factory=list)  # siblings forked this step (n > 1)
