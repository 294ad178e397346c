"""What schedule() hands the engine and what process_outputs() hands back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.scheduler.sequence import Sequence


class StepKind(enum.Enum):
    PROMPT = 0
    DECODE = 1
    EMPTY_PROMPT = 2  # nothing local to prefill, but a peer rank prefills (S10)


@dataclass(slots=True)
class ScheduledSequence:
    """The scheduler's own handle of a row while it builds and then processes a step:
    q query positions of ``seq`` ending at seqlen_k (S36). The engine never sees it."""

    seq: Sequence
    query_len: int
    seqlen_k: int
    sample: bool

    def row(self) -> ScheduledRow:
        """The row as plain values, for the engine (built positionally: a step makes
        one per row, so its cost is the scheduler's per-row cost)."""
        seq = self.seq
        tokens = seq.token_ids
        return ScheduledRow(
            seq.attempt, self.query_len, self.seqlen_k, self.sample,
            tuple(tokens[self.seqlen_k - self.query_len:self.seqlen_k]), len(tokens),
            tuple(seq.block_table), seq.state_slot, seq.sampling,
            tuple(seq.draft_token_ids) if seq.draft_token_ids else (),
            tuple(seq.forks) if self.sample and seq.forks else (),
            tuple(tokens) if seq.sampling.has_controls else None,
            seq.prompt_len, seq.eos_token_id, seq.so_status == 1)


class ScheduledRow(NamedTuple):
    """One row of a step as the engine reads it: plain values taken when the step was
    scheduled. ``query_len`` positions of ``attempt``'s history ending at ``seqlen_k``
    (S36); a decode row with a draft computes its last token and each drafted one."""

    attempt: str
    query_len: int
    seqlen_k: int
    sample: bool  # a token is sampled: the row completes the history, or it is a decode row
    token_ids: tuple[int, ...]  # the history's tokens at the query positions
    output_index: int  # the history's length: where the token drawn goes
    block_table: tuple[int, ...]  # covers seqlen_k positions
    state_slot: int  # the sliding-window rings' slot (-1: none)
    sampling: SamplingParams
    draft: tuple[int, ...] = ()  # speculative decoding: the drafted tokens it verifies
    # n > 1: (attempt, sampling) of each fork whose first token this row draws too
    forks: tuple[tuple[str, SamplingParams], ...] = ()
    # What logits controls read (penalties, bias, min_tokens, a grammar): the whole
    # history, only on rows whose sampling has any
    history: tuple[int, ...] | None = None
    prompt_len: int = 0
    eos_token_id: int | None = None
    guided: bool = False  # an active structured-output matcher

    @property
    def start_pos(self) -> int:
        return self.seqlen_k - self.query_len

    @property
    def positions(self) -> range:
        return range(self.seqlen_k - self.query_len, self.seqlen_k)


@dataclass
class SchedulerOutput:
    """A step: its kind, its rows as plain data (``scheduled``) and the block and slot
    copies to run first; the scheduler keeps its own handles of the rows (``placed``)
    for ``process_outputs``."""

    kind: StepKind
    scheduled: list[ScheduledRow] = field(default_factory=list)
    ignored: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0  # budget charged, cp_align padding included
    num_preempted: int = 0
    preempted: list[Sequence] = field(default_factory=list)  # in preemption order
    # Copy-on-write for forks, to run before the step writes: (src, dst) ids.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    placed: list[ScheduledSequence] = field(default_factory=list, repr=False)

    @property
    def is_empty(self) -> bool:
        return not self.placed

    @property
    def num_tokens(self) -> int:
        """Useful query positions (without alignment padding)."""
        return sum(row.query_len for row in self.placed)


@dataclass(frozen=True)
class QueueCounts:
    """A scheduler's queues and pools at a moment, as numbers (the engine's stats)."""

    num_waiting: int
    outstanding_prompt_tokens: int  # prompt positions the waiting still have to compute
    num_running: int  # finished ones the next decode pass sweeps are not counted
    num_prompted: int
    num_free_blocks: int
    num_preemptions: int
    cache_queried_tokens: int  # prefix caching: prompt tokens looked up ...
    cache_hit_tokens: int  # ... and found
    cache_evictions: int
    num_cached_blocks: int


@dataclass
class StepResult:
    updated: list[Sequence] = field(default_factory=list)  # got a new token this step
    finished: list[Sequence] = field(default_factory=list)  # each finished sequence once
    handed_off: list[Sequence] = field(default_factory=list)  # PROMPT engine, still own blocks
    forked: list[Sequence] = field(default_factory=list)  # siblings forked this step (n > 1)
