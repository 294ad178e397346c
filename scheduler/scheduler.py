"""Chooses each step's batch (spec S4-S35). Pure Python, no torch.

Here: admission, forks, the step-kind votes (S6-S11), the opt-in policies (spec
section 9) and processing a step's outputs (S32). The prefill path (S12-S25) is
scheduler/prefill_path.py, the decode path and preemption (S26-S30)
scheduler/decode_path.py, blocks and state slots (S1-S5, S15, S27, S28, S35)
scheduler/block_manager.py; ``Scheduler`` is all of them."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from pdserve.scheduler.block_manager import BlockManager
from pdserve.scheduler.block_pool import AllocStatus
from pdserve.scheduler.chunk_sizer import ChunkSizer
from pdserve.scheduler.config import EngineType, SchedulerConfig
from pdserve.scheduler.decode_path import DecodePath
from pdserve.scheduler.output import QueueCounts, SchedulerOutput, StepKind, StepResult
from pdserve.scheduler.prefill_path import PrefillPath
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.scheduler.sequence import Sequence, SequenceStatus
from pdserve.scheduler.votes import Communicator, SingleRankCommunicator

logger = logging.getLogger(__name__)

WAITING = SequenceStatus.WAITING


class Scheduler(PrefillPath, DecodePath, BlockManager):
    def __init__(
        self,
        config: SchedulerConfig,
        engine_type: EngineType = EngineType.NORMAL,
        communicator: Communicator | None = None,
    ) -> None:
        config.check_engine_type(engine_type)
        BlockManager.__init__(self, config)
        self.engine_type = EngineType(engine_type)
        self.comm = communicator if communicator is not None else SingleRankCommunicator()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # may hold finished sequences until the next decode pass
        self.prompted: deque[tuple[Sequence, bool]] = deque()
        self.decode_step = 0
        self.num_preemptions = 0
        # Checks each token appended to a sequence with an active structured-output
        # matcher (so_status 1); False refuses it (so_status -1). The engine's matchers.
        self.token_check: Callable[[Sequence, int], bool] | None = None
        self._live: dict[str, Sequence] = {}  # admitted, not retired, not handed off
        self._unreported: list[Sequence] = []  # retired since the last process_outputs
        self._maybe_finished_in_queues = False  # set by abort and by every finish
        # Copy-on-write of siblings forked since the last step: the next step runs them.
        self._next_copies = SchedulerOutput(StepKind.DECODE)
        self._drafted: list[Sequence] = []  # given a draft for the next step (set_drafts)
        self._install_policies(config)

    # ---- policies (spec section 9): each a named hook, the default first ----

    def _install_policies(self, config: SchedulerConfig) -> None:
        waiting, free_blocks = self.waiting, self.blocks.free_queue

        def has_free_block(seq: Sequence) -> bool:  # the released policy
            return len(free_blocks) > 0

        self._requeue_partial = waiting.append if config.continuation_at_back else waiting.appendleft
        self._candidate_fits = (
            self._has_room_or_free_block if config.decode_room_needs_no_block else has_free_block
        )
        self._bypass_later_head = (
            self._bypass_with_aging if config.hol_bypass_limit > 0 else self._never_bypass
        )
        self._requeue_preempted = (
            self._requeue_behind_partial if config.partial_prompts_first else waiting.appendleft
        )
        self.chunk_sizer = None if config.chunk_time_budget_s is None else ChunkSizer(
            config.chunk_time_budget_s, floor=config.block_size)

    def _prefill_budget(self) -> int:
        """Positions a prompt step may take: the configured budget, or with the chunk
        sizer, what fits its time quota after the head's cached prefix, the minimum over
        the data-parallel group (every rank calls this at the same point, so the
        collective matches; the slowest rank's step sets the group's pace)."""
        cfg = self.config
        if self.chunk_sizer is None:
            return cfg.max_num_batched_tokens
        cached = self.waiting[0].processed if self.waiting else 0
        local = self.chunk_sizer.budget(cached) or cfg.max_num_batched_tokens
        return self.comm.all_reduce_min(local)

    def observe_prompt_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine's measured time of a prompt step (model run), for the chunk sizer."""
        if self.chunk_sizer is not None and out.kind == StepKind.PROMPT:
            self.chunk_sizer.observe([(r.query_len, r.start_pos) for r in out.scheduled],
                                     seconds)

    def _has_room_or_free_block(self, seq: Sequence) -> bool:
        return self.blocks.num_free > 0 or len(seq.block_table) >= self.blocks_needed(seq)

    def _requeue_behind_partial(self, seq: Sequence) -> None:
        front = 0
        while front < len(self.waiting) and self.waiting[front].block_table:
            front += 1
        self.waiting.insert(front, seq)

    def _never_bypass(self, head: Sequence) -> bool:
        return False

    def _bypass_with_aging(self, head: Sequence) -> bool:
        """Move the first fresh request behind a LATER head that fits now to the front;
        the head is passed at most hol_bypass_limit times, after that it blocks as usual."""
        if head.bypassed >= self.config.hol_bypass_limit:
            return False
        limit = self.config.prompt_limit
        for i in range(1, len(self.waiting)):
            seq = self.waiting[i]
            if seq.status.is_finished or not seq.schedulable or seq.block_table:
                continue
            if len(seq) <= limit and self._can_allocate_with_state(self.blocks_needed(seq)) == AllocStatus.OK:
                del self.waiting[i]
                self.waiting.appendleft(seq)
                head.bypassed += 1
                return True
        return False

    # ---- public API ----

    def add(self, seq: Sequence) -> None:
        if self.engine_type == EngineType.COMPLETION:
            raise RuntimeError("a COMPLETION engine takes prefilled sequences: use add_prefilled")
        self._admit(seq)
        if seq.moved:
            self._queue_moved(seq)
        else:
            self.waiting.append(seq)

    def _queue_moved(self, seq: Sequence) -> None:
        """A request moved here from another rank has waited there already: it goes
        ahead of fresh arrivals, behind the prompts already begun (S30's front) and the
        requests moved before it, so the chapter's order holds among each kind."""
        front = 0
        while front < len(self.waiting) and (self.waiting[front].block_table
                                             or self.waiting[front].moved):
            front += 1
        self.waiting.insert(front, seq)

    def can_admit_prefilled(self, num_tokens: int, num_forks: int = 0,
                            num_held: int = 0) -> AllocStatus:
        """Room for a prefilled sequence of ``num_tokens`` (``num_held`` of its blocks
        already held: its cached prefix) and ``num_forks`` siblings forked from it at
        once (each its own copy of a partial last block and a slot)."""
        return self._can_allocate_group(
            self._ceil_blocks(num_tokens) - num_held
            + num_forks * self._partial_blocks(num_tokens), 1 + num_forks)

    def add_prefilled(self, seq: Sequence, cached: list[int] = ()) -> None:
        """Own a sequence prefilled elsewhere: blocks for its processed positions (its
        ``cached`` prefix blocks first, already referenced: ``take_cached_prefix``) and
        a state slot, then it waits in `prompted` for S27 to admit it."""
        status = self.can_admit_prefilled(seq.processed, num_held=len(cached))
        if status != AllocStatus.OK:
            raise RuntimeError(f"cannot admit prefilled {seq.attempt!r}: {status.name}")
        self._admit(seq)
        seq.block_table = list(cached) + self.blocks.allocate(
            self._ceil_blocks(seq.processed) - len(cached))
        seq.num_registered = len(cached)
        seq.state_slot = self.states.allocate_one()
        self.prompted.append((seq, False))

    def admit_imported(self, seq: Sequence, first_token_id: int, first_token_time: float,
                       cached: list[int], cached_hashes: list[bytes],
                       forks: list[tuple[str, SamplingParams]],
                       fork_tokens: list[int]) -> list[Sequence]:
        """A COMPLETION engine's import of a new sequence whose prompt was prefilled
        elsewhere: owned as ``add_prefilled`` does, its streamed blocks' hashes kept
        (``cached_hashes``), the siblings of n > 1 forked from it with their first
        tokens (``fork_tokens``), and its own first token appended. Returns the group,
        the sequence first; its KV is imported next, then ``register_prefilled``."""
        seq.processed = seq.prompt_len
        self.add_prefilled(seq, cached)
        if cached_hashes:  # streamed blocks: named from here on
            seq.block_hashes = list(cached_hashes)
            seq.num_registered = 0
        # n > 1: the forks share the prompt's blocks (their copies run before the next
        # step's model, after the import)
        group = [seq, *self.fork_siblings(seq, forks, fork_tokens, StepResult())]
        seq.token_ids.append(first_token_id)
        for member in group:  # drawn on the prefill rank: TTFT counts from there
            member.first_token_time = first_token_time
        return group

    def release_handed_off(self, seq: Sequence) -> None:
        """The engine exported a handed-off sequence's KV: its blocks go back (S35)."""
        self._free_resources(seq)

    def abort(self, attempt: str) -> bool:
        """Mark it aborted; the next pass sweeps it and frees its blocks (S33)."""
        seq = self._live.get(attempt)
        if seq is None or seq.status.is_finished:
            return False
        seq.status = SequenceStatus.FINISHED_ABORTED
        self._maybe_finished_in_queues = True
        return True

    def fork(self, parent: Sequence, child_attempt: str,
             sampling: SamplingParams | None = None, queue: bool = True) -> Sequence:
        """A child sharing the parent's cached prefix: it pins the parent's blocks and
        state slot and gets its own copies when admitted (S34, S15, S27). ``queue``
        False: the caller places it (a PROMPT engine hands siblings off with it)."""
        if parent.status.is_finished or not parent.block_table or parent.in_flight:
            raise RuntimeError(f"cannot fork {parent.attempt!r}: needs cached, settled KV")
        child = Sequence(child_attempt, parent.prompt_token_ids,
                         parent.sampling if sampling is None else sampling,
                         arrival_time=parent.arrival_time, eos_token_id=parent.eos_token_id)
        child.token_ids = list(parent.token_ids)
        child.processed = parent.processed
        child.checkpoints = list(parent.checkpoints)
        child.so_status = parent.so_status
        child.first_scheduled_time = parent.first_scheduled_time
        child.fork_of = parent.attempt
        child.block_hashes = list(parent.block_hashes)
        child.num_registered = parent.num_registered
        child.num_cached_tokens = parent.num_cached_tokens
        self._admit(child)
        child.block_table = list(parent.block_table)
        self.blocks.pin(child.block_table)
        child.state_slot = parent.state_slot
        self.states.pin([child.state_slot])
        child.fork_pending = True
        if not queue:
            return child
        if child.processed < child.prompt_len:
            self.waiting.appendleft(child)
        else:
            self.prompted.append((child, True))
        return child

    def fork_siblings(self, parent: Sequence, specs: list[tuple[str, SamplingParams]],
                      first_tokens: list[int], result: StepResult) -> list[Sequence]:
        """n > 1: siblings of a sequence whose prompt just completed (its own token not
        appended yet), each with the first token drawn for it from the same logits.

        They share the prompt's KV (S34) and take their own copies of the partial last
        block and the state slot at once (copies that run before the next step's model,
        so the parent's next token never lands in them). PROMPT: they stay pinned and
        leave with the parent in one hand-off. A sibling finished by its first token is
        retired at once; one with no room for its copies is recomputed from its history
        (NORMAL, S30; a COMPLETION engine's import checked room for all)."""
        if len(first_tokens) != len(specs):
            raise ValueError(f"{len(first_tokens)} first tokens for {len(specs)} forks "
                             f"of {parent.attempt!r}")
        children = []
        for (child_id, sampling), token in zip(specs, first_tokens, strict=True):
            child = self.fork(parent, child_id, sampling, queue=False)
            children.append(child)
            if not self._append_token(child, token, result):
                continue  # finished by its first token: retired, its pins released
            if self.engine_type == EngineType.PROMPT:
                del self._live[child.attempt]
                result.handed_off.append(child)
            elif self._can_allocate_group(self._partial_blocks(child.processed), 1) \
                    == AllocStatus.OK:
                self._unshare(child, self._next_copies)
                self.prompted.append((child, False))
            elif self.engine_type == EngineType.COMPLETION:
                raise RuntimeError(f"no room for the KV copies of fork {child_id!r}: "
                                   "its import should have checked (can_admit_prefilled)")
            else:
                logger.warning("fork %s has no room for its own KV copies and will be "
                               "recomputed", child_id)
                self._free_resources(child)
                child.reset_for_recompute()
                child.fork_pending = False
                self._requeue_preempted(child)
        return children

    def counts(self) -> QueueCounts:
        blocks = self.blocks
        return QueueCounts(
            num_waiting=len(self.waiting),
            outstanding_prompt_tokens=sum(len(s) - s.processed for s in self.waiting),
            # finished sequences may sit in `running` until the next decode pass (S26)
            num_running=sum(not s.is_finished for s in self.running),
            num_prompted=len(self.prompted), num_free_blocks=blocks.num_free,
            num_preemptions=self.num_preemptions,
            cache_queried_tokens=self.num_cache_queried_tokens,
            cache_hit_tokens=self.num_cache_hit_tokens,
            cache_evictions=blocks.num_evictions, num_cached_blocks=blocks.num_cached)

    def get_sequence(self, attempt: str) -> Sequence | None:
        return self._live.get(attempt)

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._unreported)

    def assert_drained(self) -> None:
        problems = self._leaks()
        if problems:
            holders = [s for s in (*self._live.values(), *self.running) if s.block_table]
            raise AssertionError("; ".join(problems) + f"; holders: {holders[:8]}")

    # ---- choosing the kind of step (S6-S11) ----

    def schedule(self) -> SchedulerOutput:
        out = self._schedule()
        if out.kind == StepKind.PROMPT:  # when each prompt first ran: the TTFT breakdown
            now = time.monotonic()
            for row in out.placed:
                if row.seq.first_scheduled_time is None:
                    row.seq.first_scheduled_time = now
        out.scheduled = [row.row() for row in out.placed]
        copies = self._next_copies
        if copies.block_copies or copies.state_copies:
            # forks made since the last step: their copies run first (before any write)
            out.block_copies[:0] = copies.block_copies
            out.state_copies[:0] = copies.state_copies
            self._next_copies = SchedulerOutput(StepKind.DECODE)
        return out

    def _schedule(self) -> SchedulerOutput:
        if self.engine_type == EngineType.PROMPT:
            out = self._schedule_prefill(self._prefill_budget())
            self.decode_step = 0
            return out
        if self.engine_type == EngineType.COMPLETION:
            return self._schedule_decode()
        return self._schedule_normal()

    def _schedule_normal(self) -> SchedulerOutput:
        step, cfg = self.decode_step, self.config
        any_point = step != 0 and step % cfg.prefill_any_attempt_interval == 0
        if not any_point and step % cfg.prefill_attempt_interval != 0:
            return self._schedule_decode()
        want = self._wants_prefill()
        if not self._vote_try(want, any_point):
            return self._schedule_decode()
        budget = self._prefill_budget()
        result = self._schedule_prefill(budget) if want else None
        # Second vote: an empty prompt step everywhere would reset the counter and
        # starve running forever, so with no result anywhere the group decodes.
        if self.comm.all_reduce_min(0 if result is not None else 1) != 0:
            return self._schedule_decode()
        self.decode_step = 0
        return result if result is not None else SchedulerOutput(StepKind.EMPTY_PROMPT)

    def _wants_prefill(self) -> bool:
        if not self.waiting or not self.waiting[0].schedulable:
            return False
        if self.cache_usage <= self.config.prefill_watermark:
            return True
        # Policy: a partial prompt needs no new block, and finishing it is what frees them.
        return self.config.partial_prompts_first and bool(self.waiting[0].block_table)

    def _vote_try(self, want: bool, any_point: bool) -> bool:
        if any_point:  # one wish is enough
            return self.comm.all_reduce_min(0 if want else 1) == 0
        return self.comm.all_reduce_min(1 if want else 0) == 1  # every rank must wish

    # ---- processing a step's outputs (S32) ----

    def process_outputs(self, output: SchedulerOutput,
                        sampled_token_ids: list[int | list[int] | None],
                        fork_tokens: dict[str, list[int]] | None = None) -> StepResult:
        """``fork_tokens``: attempt -> the first tokens drawn for its ``forks``, for
        each prompt completed this step that has any (n > 1). A decode row with a draft
        gets a list: the drafted tokens accepted and the one drawn after them."""
        rows = output.placed
        if len(sampled_token_ids) != len(rows):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(rows)} scheduled rows")
        result = StepResult()
        if output.kind == StepKind.DECODE:
            self._process_decode(rows, sampled_token_ids, result)
        else:
            self._process_prompt(rows, sampled_token_ids, result, fork_tokens or {})
        result.finished.extend(self._unreported)
        self._unreported.clear()
        for seq in self._drafted:  # verified, or never scheduled: a draft lives one step
            seq.draft_len, seq.draft_token_ids = 0, []
        self._drafted = []
        return result

    def set_drafts(self, drafts: list[tuple[Sequence, list[int]]]) -> None:
        """Speculative decoding: the tokens proposed to follow each sequence's history,
        verified by the next step (its row computes 1 + len(draft) positions, S4) and
        dropped once that step is processed."""
        for seq, draft in drafts:
            seq.draft_token_ids, seq.draft_len = list(draft), len(draft)
            self._drafted.append(seq)

    def _process_decode(self, rows, tokens, result: StepResult) -> None:
        append_token = self._append_token
        for row, token in zip(rows, tokens, strict=True):
            seq = row.seq
            if seq.status is WAITING:  # preempted while in flight: stale output (S32)
                continue
            seq.in_flight -= row.query_len
            if seq.status.is_finished:
                self._retire(seq)
                continue
            # a speculative row: its accepted drafts and the token after them, in order,
            # each a position computed; the stop rules end it at the first that stops
            for t in token if isinstance(token, list) else (token,):
                seq.processed += 1
                if self.caching and seq.processed % self._block_size == 0:
                    self._register_full_blocks(seq)
                if not append_token(seq, t, result):
                    break

    def _process_prompt(self, rows, tokens, result: StepResult,
                        fork_tokens: dict[str, list[int]]) -> None:
        for row, token in zip(rows, tokens, strict=True):
            seq = row.seq
            seq.in_flight = max(0, seq.in_flight - row.query_len)
            if seq.status.is_finished:  # aborted while its chunk was in flight
                self._retire(seq)
                continue
            seq.processed += row.query_len
            if self.caching:
                self._register_full_blocks(seq)
            if not row.sample:
                if seq.status != WAITING:
                    raise RuntimeError(f"unfinished prompt {seq.attempt!r} is {seq.status.name}")
                self._requeue_partial(seq)
                continue
            if seq.forks:  # n > 1: the siblings fork from the prompt's KV before its token
                specs, seq.forks = seq.forks, []
                result.forked += self.fork_siblings(seq, specs, fork_tokens[seq.attempt],
                                                    result)
            if self.engine_type != EngineType.PROMPT:
                self.running.append(seq)
            if self._append_token(seq, token, result) and self.engine_type == EngineType.PROMPT:
                # Ownership moves to the engine until it has exported the KV.
                del self._live[seq.attempt]
                result.handed_off.append(seq)

    def _append_token(self, seq: Sequence, token: int | None, result: StepResult) -> bool:
        """Append the sampled token and apply the stop rules in order; True if it goes on."""
        if token is None:
            raise ValueError(f"row of {seq.attempt!r} needs a sampled token")
        history = seq.token_ids
        history.append(token)
        if seq.so_status == 1 and self.token_check is not None \
                and not self.token_check(seq, token):
            seq.so_status = -1  # the grammar refused it: structured_output_failed below
        if seq.first_token_time is None and len(history) - seq.prompt_len == 1:
            seq.first_token_time = time.monotonic()
        result.updated.append(seq)
        sampling = seq.sampling
        if (token == seq.eos_token_id and not sampling.ignore_eos) or token in sampling.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif len(history) > self.config.max_model_len or len(history) - seq.prompt_len >= sampling.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        elif seq.so_status == -1:
            seq.status = SequenceStatus.FINISHED_SO_FAILED
        else:
            return True
        self._retire(seq)
        return False

    # ---- admission and retirement ----

    def _admit(self, seq: Sequence) -> None:
        if seq.attempt in self._live:
            raise ValueError(f"attempt {seq.attempt!r} is already scheduled")
        if seq.status != WAITING or seq.retired:
            raise ValueError(f"request {seq.attempt!r} must be new and WAITING, is {seq.status.name}")
        self._live[seq.attempt] = seq

    def _retire(self, seq: Sequence) -> bool:
        """A finished sequence frees everything it held and is reported, exactly once (S35)."""
        if seq.retired:
            return False
        seq.retired = True
        self._maybe_finished_in_queues = True
        self._free_resources(seq)
        self._live.pop(seq.attempt, None)
        self._unreported.append(seq)
        return True

    def _retire_into(self, seq: Sequence, ignored: list[Sequence]) -> None:
        if self._retire(seq):
            ignored.append(seq)
