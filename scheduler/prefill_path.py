"""The prefill path (S12-S25): which prompts from the head of ``waiting`` a prompt
step takes, and how many of their positions."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

from pdserve.scheduler.block_manager import BlockManager
from pdserve.scheduler.block_pool import AllocStatus
from pdserve.scheduler.config import EngineType
from pdserve.scheduler.output import ScheduledSequence, SchedulerOutput, StepKind
from pdserve.scheduler.sequence import Sequence, SequenceStatus

WAITING = SequenceStatus.WAITING
RUNNING = SequenceStatus.RUNNING


class _Head(enum.Enum):
    GO = 0  # the head may be scheduled now
    NEXT = 1  # the head left the queue or gave way: look at the new head
    STOP = 2  # the head blocks the queue this step


class PrefillPath(BlockManager):
    """The Scheduler's prefill path; it reads the Scheduler's queues and hooks below."""

    engine_type: EngineType
    waiting: deque[Sequence]
    running: list[Sequence]
    _bypass_later_head: Callable[[Sequence], bool]  # a policy (spec section 9)
    _retire_into: Callable[[Sequence, list[Sequence]], None]

    def _schedule_prefill(self, budget: int) -> SchedulerOutput | None:
        out = SchedulerOutput(StepKind.PROMPT)
        num_curr_seqs = len(self.running)
        budget_used = 0
        sum_k = 0
        waiting = self.waiting
        while waiting:
            seq = waiting[0]
            verdict, hits = self._vet_head(seq, out)
            if verdict is _Head.NEXT:
                continue
            if verdict is _Head.STOP or self._at_row_limits(num_curr_seqs, sum_k, seq):
                break
            sum_k += len(seq)
            taken = self._take_head(seq, hits, budget - budget_used, out)
            if taken is None:  # S20-S22
                break
            charged, chunked = taken
            budget_used += charged
            if not chunked:
                num_curr_seqs += 1
            elif self.engine_type == EngineType.NORMAL:  # S24
                break
        out.num_batched_tokens = budget_used
        if self.engine_type == EngineType.NORMAL and not out.placed and not out.ignored:
            return None  # S25: the vote decides
        return out

    def _vet_head(self, seq: Sequence, out: SchedulerOutput) -> tuple[_Head, list[int]]:
        """S12-S15: may the head of ``waiting`` be scheduled now? With the cached blocks
        a fresh prompt would take."""
        if seq.status.is_finished:  # S12
            self.waiting.popleft()
            self._retire_into(seq, out.ignored)
            return _Head.NEXT, []
        if not seq.schedulable:  # S13
            return _Head.STOP, []
        if not seq.block_table:
            return self._vet_fresh(seq, out)
        if seq.fork_pending and self._fork_blocks_status(seq) != AllocStatus.OK:
            return _Head.STOP, []  # S15
        return _Head.GO, []

    def _vet_fresh(self, seq: Sequence, out: SchedulerOutput) -> tuple[_Head, list[int]]:
        hits = self._cached_prefix(seq)
        verdict = self._check_fresh(seq, hits)
        if verdict is AllocStatus.LATER:
            if self._bypass_later_head(seq):
                return _Head.NEXT, hits
            return _Head.STOP, hits  # head-of-line blocking (S14)
        if verdict is AllocStatus.NEVER:
            self.waiting.popleft()
            seq.status = SequenceStatus.FINISHED_IGNORED
            self._retire_into(seq, out.ignored)
            return _Head.NEXT, hits
        return _Head.GO, hits

    def _check_fresh(self, seq: Sequence, hits: list[int]) -> AllocStatus:
        """S14: a fresh prompt longer than the limit can never run; else the joint check
        (cached blocks it takes that sit in the free list count against it too)."""
        if len(seq) > self.config.prompt_limit:
            return AllocStatus.NEVER
        needed = self.blocks_needed(seq) - len(hits)
        if hits:
            needed += self.blocks.num_free_among(hits)
        return self._can_allocate_with_state(needed)

    def _at_row_limits(self, num_curr_seqs: int, sum_k: int, seq: Sequence) -> bool:
        """S16: one more sequence would pass max_num_seqs; S17: the whole length (not
        this chunk's keys) would pass prefill_max_sum_seqlen_k."""
        cfg = self.config
        if num_curr_seqs + 1 > cfg.max_num_seqs:  # S16
            return True
        limit = cfg.prefill_max_sum_seqlen_k
        return limit is not None and limit - sum_k < len(seq)  # S17

    def _take_head(self, seq: Sequence, hits: list[int], budget_left: int,
                   out: SchedulerOutput) -> tuple[int, bool] | None:
        """The head's chunk (S18-S22) committed to the step and out of ``waiting``: the
        budget it is charged (S23) and whether it is partial; None when none fits."""
        cfg = self.config
        q, chunked = self._chunk_len(seq, budget_left,
                                     len(hits) * cfg.block_size if hits else seq.processed)
        if q is None:  # S20-S22
            return None
        charged = -(-q // cfg.cp_align) * cfg.cp_align  # S23
        self._commit_prompt(seq, q, chunked, out, hits)
        self.waiting.popleft()
        return charged, chunked

    def _chunk_len(self, seq: Sequence, budget_left: int,
                   processed: int | None = None) -> tuple[int | None, bool]:
        """``processed``: where the chunk starts (a fresh prompt's cached prefix ends)."""
        cfg = self.config
        if processed is None:
            processed = seq.processed
        work = len(seq) - processed  # S18
        align = cfg.cp_align
        q = min(work, budget_left // align * align)
        ckpts = seq.checkpoints  # S19
        while ckpts and ckpts[0] <= processed:
            ckpts.pop(0)
        if ckpts and processed + q >= ckpts[0]:
            q = ckpts[0] - processed  # consumed once processed reaches it
        chunked = q < work
        if q == 0 or (chunked and not cfg.chunked_prefill) or q < max(cfg.lookahead_tokens, 1):
            return None, chunked  # S20, S21, S22
        return q, chunked

    def _commit_prompt(self, seq: Sequence, q: int, chunked: bool, out: SchedulerOutput,
                       hits: list[int] = ()) -> None:
        if seq.status != WAITING:
            raise RuntimeError(f"prompt of {seq.attempt!r} selected while {seq.status.name}")
        if not seq.block_table:
            if self.caching:
                self._take_cached_prefix(seq, hits)
            seq.block_table += self.blocks.allocate(self.blocks_needed(seq) - len(seq.block_table))
            seq.state_slot = self.states.allocate_one()
        elif seq.fork_pending:
            self._unshare(seq, out)
            missing = self.blocks_needed(seq) - len(seq.block_table)
            if missing > 0:
                seq.block_table += self.blocks.allocate(missing)
        if not chunked:
            seq.status = RUNNING
        seqlen_k = seq.processed + seq.in_flight + q  # S36
        seq.in_flight += q
        out.placed.append(ScheduledSequence(seq, q, seqlen_k, not chunked))
