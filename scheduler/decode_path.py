"""The decode path (S26-S29) and preemption (S30): which running sequences decode a
token in the next step, and which give their blocks up so the others can."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from pdserve.scheduler.block_manager import BlockManager
from pdserve.scheduler.output import ScheduledSequence, SchedulerOutput, StepKind
from pdserve.scheduler.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

WAITING = SequenceStatus.WAITING
RUNNING = SequenceStatus.RUNNING


class DecodePath(BlockManager):
    """The Scheduler's decode path; it reads the Scheduler's queues and hooks below."""

    running: list[Sequence]
    waiting: deque[Sequence]
    prompted: deque[tuple[Sequence, bool]]
    decode_step: int
    num_preemptions: int
    _maybe_finished_in_queues: bool
    _candidate_fits: Callable[[Sequence], bool]  # policies (spec section 9)
    _requeue_preempted: Callable[[Sequence], None]
    _retire_into: Callable[[Sequence, list[Sequence]], None]

    def _schedule_decode(self) -> SchedulerOutput:
        out = SchedulerOutput(StepKind.DECODE)
        self._sweep_finished(out.ignored)
        self._admit_prompted(out)
        running = self.running
        # Longest output first, ties in arrival order: candidates come from the end.
        running.sort(key=decode_priority)
        max_seqs = self.config.max_num_seqs
        candidate_fits = self._candidate_fits
        scheduled: list[Sequence] = []
        left, right = 0, len(running)
        append_slot = self._append_slot
        while left < right and len(scheduled) < max_seqs:
            seq = running[right - 1]
            if seq.draft_len:  # free blocks stay for the candidates left to visit
                self._fit_draft(seq, self.blocks.num_free - (right - left))
            fits = candidate_fits(seq)
            if not fits and seq.draft_len:  # a draft never costs anyone a preemption
                self._fit_draft(seq, 0)
                fits = candidate_fits(seq)
            while not fits and right - left > 1:
                self._preempt(running[left], out)
                left += 1
                fits = candidate_fits(seq)
            if fits:
                append_slot(seq)
                scheduled.append(seq)
            else:
                self._preempt(seq, out)
            right -= 1
        scheduled.sort(key=len, reverse=True)  # S29: batch order, longest history first
        # S36, before the in-flight counts grow; a row with a draft computes its positions
        # too (speculative decoding: its last token and each drafted one)
        out.placed = rows = [
            ScheduledSequence(seq, 1 + seq.draft_len,
                              seq.processed + seq.in_flight + 1 + seq.draft_len, True)
            for seq in scheduled
        ]
        for row in rows:
            row.seq.in_flight += row.query_len
        out.num_batched_tokens = sum(row.query_len for row in rows)
        # Anything the max_num_seqs cap left unvisited stays running, unscheduled.
        self.running = scheduled + running[left:right] if left < right else scheduled
        self.decode_step += 1  # S11
        return out

    def _fit_draft(self, seq: Sequence, spare: int) -> None:
        """Cut ``seq``'s draft (speculative decoding) to the positions its blocks hold and
        ``spare`` (if > 0) more blocks' worth: a draft never takes a block another
        sequence needs."""
        bs = self._block_size
        room = (len(seq.block_table) + max(spare, 0)) * bs - len(seq) - seq.in_flight
        if room < seq.draft_len:
            keep = max(room, 0)
            seq.draft_len, seq.draft_token_ids = keep, seq.draft_token_ids[:keep]

    def _sweep_finished(self, ignored: list[Sequence]) -> None:
        """S26: finished sequences leave running; aborted ones can sit anywhere in waiting."""
        if not self._maybe_finished_in_queues:  # spares a scan of both queues every step
            return
        keep = []
        for seq in self.running:
            if seq.status.is_finished:
                self._retire_into(seq, ignored)
            else:
                keep.append(seq)
        self.running = keep
        for seq in [s for s in self.waiting if s.status.is_finished]:
            self.waiting.remove(seq)
            self._retire_into(seq, ignored)
        self._maybe_finished_in_queues = False

    def _admit_prompted(self, out: SchedulerOutput) -> None:
        """S27: prefilled (imported or forked) sequences join running while there is room."""
        prompted, max_seqs = self.prompted, self.config.max_num_seqs
        while prompted and len(self.running) < max_seqs:
            seq, forked = prompted[0]
            if seq.status.is_finished:
                prompted.popleft()
                self._retire_into(seq, out.ignored)
                continue
            if forked:
                if self.blocks.num_free < 1 or self.states.num_free < 1:
                    break
                self._unshare(seq, out)
            prompted.popleft()
            if seq.status == WAITING:
                seq.status = RUNNING
            self.running.append(seq)

    # ---- preemption (S30) ----

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if seq.status != RUNNING:
            raise RuntimeError(f"preempting {seq.attempt!r} while {seq.status.name}")
        self.num_preemptions += 1
        out.num_preempted += 1
        out.preempted.append(seq)
        stop = self.config.stop_preempted_request
        # a matcher is kept through a recompute when the section 9 policy is on
        guided_stops = seq.so_status == -1 or (
            seq.so_status == 1 and not self.config.recompute_structured_output)
        if stop or guided_stops:
            why = "stop_preempted_request is set" if stop else (
                f"structured output (so_status {seq.so_status}) cannot be recomputed")
            logger.warning("request %s is preempted and stops: %s", seq.attempt, why)
            seq.status = SequenceStatus.FINISHED_PREEMPTED
            self._retire_into(seq, out.ignored)
            return
        logger.warning("request %s is preempted and will be recomputed", seq.attempt)
        seq.reset_for_recompute()
        self._requeue_preempted(seq)
        seq.status = WAITING
        self._free_resources(seq)


def decode_priority(seq: Sequence) -> tuple[int, float, int]:
    """Sort key of running before a decode pass (S28): longest output first, ties in
    arrival order. Candidates come from the end of the sorted list, victims from the front."""
    return (seq.prompt_len - len(seq.token_ids), seq.arrival_time, seq.order)
