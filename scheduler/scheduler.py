"""Chooses each step's batch: the step-kind votes, the prefill and decode paths,
preemption and output processing of the spec (S4-S35). Pure Python, no torch."""

from __future__ import annotations

import logging
import time
from collections import deque

from pdserve.scheduler.block_pool import AllocStatus, BlockPool, CachingBlockPool
from pdserve.scheduler.chunk_sizer import ChunkSizer
from pdserve.scheduler.config import EngineType, SchedulerConfig
from pdserve.scheduler.output import ScheduledSequence, SchedulerOutput, StepKind, StepResult
from pdserve.scheduler.prefix_hash import cacheable_blocks, chain_hashes
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.scheduler.sequence import Sequence, SequenceStatus
from pdserve.scheduler.votes import Communicator, SingleRankCommunicator

logger = logging.getLogger(__name__)

WAITING = SequenceStatus.WAITING
RUNNING = SequenceStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        engine_type: EngineType = EngineType.NORMAL,
        communicator: Communicator | None = None,
    ) -> None:
        config.check_engine_type(engine_type)
        self.config = config
        self.engine_type = EngineType(engine_type)
        self.comm = communicator if communicator is not None else SingleRankCommunicator()
        self.caching = config.enable_prefix_caching
        self.blocks = CachingBlockPool(config.num_blocks) if self.caching else BlockPool(
            config.num_blocks)
        self.num_cache_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_cache_hit_tokens = 0  # ... and found there
        self._block_size = config.block_size
        self.states = BlockPool(config.num_state_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # may hold finished sequences until the next decode pass
        self.prompted: deque[tuple[Sequence, bool]] = deque()
        self.decode_step = 0
        self.num_preemptions = 0
        self._live: dict[str, Sequence] = {}  # admitted, not retired, not handed off
        self._unreported: list[Sequence] = []  # retired since the last process_outputs
        self._maybe_finished_in_queues = False  # set by abort and by every finish
        # Copy-on-write of siblings forked since the last step: the next step runs them.
        self._next_copies = SchedulerOutput(StepKind.DECODE)
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
        self.waiting.append(seq)

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
            raise RuntimeError(f"cannot admit prefilled {seq.request_id!r}: {status.name}")
        self._admit(seq)
        seq.block_table = list(cached) + self.blocks.allocate(
            self._ceil_blocks(seq.processed) - len(cached))
        seq.num_registered = len(cached)
        seq.state_slot = self.states.allocate_one()
        self.prompted.append((seq, False))

    def take_cached_prefix(self, token_ids: list[int], num_blocks: int) -> list[int] | None:
        """Prefix caching, a prefilled import's side: reference the cached blocks of the
        first ``num_blocks`` full blocks of ``token_ids``; None (nothing taken) unless
        all of them are cached."""
        if not self.caching:
            return None
        hits = self.blocks.lookup(chain_hashes(token_ids, self.config.block_size, num_blocks))
        if len(hits) < num_blocks:
            return None
        self.blocks.take(hits)
        return hits

    def reserve_blocks(self, num_blocks: int) -> list[int] | None:
        """Blocks for KV streamed ahead of its request (a COMPLETION engine's partial
        import), referenced until ``add_prefilled`` takes them or ``release_blocks``;
        None without room."""
        if self.blocks.can_allocate(num_blocks) != AllocStatus.OK:
            return None
        return self.blocks.allocate(num_blocks)

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop references taken by ``take_cached_prefix`` for an import that never ran."""
        if block_ids:
            self.blocks.free(block_ids)

    def register_prefilled(self, seq: Sequence) -> None:
        """Prefix caching: an imported prompt's blocks hold its KV now: name them."""
        if self.caching:
            self._register_full_blocks(seq)

    def release_handed_off(self, seq: Sequence) -> None:
        """The engine exported a handed-off sequence's KV: its blocks go back (S35)."""
        self._free_resources(seq)

    def abort(self, request_id: str) -> bool:
        """Mark it aborted; the next pass sweeps it and frees its blocks (S33)."""
        seq = self._live.get(request_id)
        if seq is None or seq.status.is_finished:
            return False
        seq.status = SequenceStatus.FINISHED_ABORTED
        self._maybe_finished_in_queues = True
        return True

    def fork(self, parent: Sequence, child_request_id: str,
             sampling: SamplingParams | None = None, queue: bool = True) -> Sequence:
        """A child sharing the parent's cached prefix: it pins the parent's blocks and
        state slot and gets its own copies when admitted (S34, S15, S27). ``queue``
        False: the caller places it (a PROMPT engine hands siblings off with it)."""
        if parent.status.is_finished or not parent.block_table or parent.in_flight:
            raise RuntimeError(f"cannot fork {parent.request_id!r}: needs cached, settled KV")
        child = Sequence(child_request_id, parent.prompt_token_ids,
                         parent.sampling if sampling is None else sampling,
                         arrival_time=parent.arrival_time, eos_token_id=parent.eos_token_id)
        child.token_ids = list(parent.token_ids)
        child.processed = parent.processed
        child.checkpoints = list(parent.checkpoints)
        child.so_status = parent.so_status
        child.first_scheduled_time = parent.first_scheduled_time
        child.fork_of = parent.request_id
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
                             f"of {parent.request_id!r}")
        children = []
        for (child_id, sampling), token in zip(specs, first_tokens, strict=True):
            child = self.fork(parent, child_id, sampling, queue=False)
            children.append(child)
            if not self._append_token(child, token, result):
                continue  # finished by its first token: retired, its pins released
            if self.engine_type == EngineType.PROMPT:
                del self._live[child.request_id]
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

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._live.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._unreported)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def cache_usage(self) -> float:
        return self.blocks.num_used / self.config.num_blocks  # S5

    def blocks_needed(self, seq: Sequence) -> int:
        return self._ceil_blocks(len(seq) + seq.in_flight + seq.draft_len)  # S4

    def assert_drained(self) -> None:
        problems = [f"blocks: {p}" for p in self.blocks.leaks()]
        problems += [f"state slots: {p}" for p in self.states.leaks()]
        if problems:
            holders = [s for s in (*self._live.values(), *self.running) if s.block_table]
            raise AssertionError("; ".join(problems) + f"; holders: {holders[:8]}")

    # ---- choosing the kind of step (S6-S11) ----

    def schedule(self) -> SchedulerOutput:
        out = self._schedule()
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

    # ---- the prefill path (S12-S25) ----

    def _schedule_prefill(self, budget: int) -> SchedulerOutput | None:
        cfg = self.config
        out = SchedulerOutput(StepKind.PROMPT)
        num_curr_seqs = len(self.running)
        budget_used = 0
        sum_k_remain = cfg.prefill_max_sum_seqlen_k
        waiting = self.waiting
        while waiting:
            seq = waiting[0]
            if seq.status.is_finished:  # S12
                waiting.popleft()
                self._retire_into(seq, out.ignored)
                continue
            if not seq.schedulable:  # S13
                break
            hits: list[int] = []
            if not seq.block_table:
                hits = self._cached_prefix(seq)
                verdict = self._check_fresh(seq, hits)
                if verdict is AllocStatus.LATER:
                    if self._bypass_later_head(seq):
                        continue
                    break  # head-of-line blocking (S14)
                if verdict is AllocStatus.NEVER:
                    waiting.popleft()
                    seq.status = SequenceStatus.FINISHED_IGNORED
                    self._retire_into(seq, out.ignored)
                    continue
            elif seq.fork_pending and self._fork_blocks_status(seq) != AllocStatus.OK:
                break  # S15
            if num_curr_seqs + 1 > cfg.max_num_seqs:  # S16
                break
            if sum_k_remain is not None:  # S17: the whole length, not this chunk's keys
                if sum_k_remain < len(seq):
                    break
                sum_k_remain -= len(seq)
            q, chunked = self._chunk_len(seq, budget - budget_used,
                                         len(hits) * cfg.block_size if hits else seq.processed)
            if q is None:  # S20-S22
                break
            budget_used += -(-q // cfg.cp_align) * cfg.cp_align  # S23
            self._commit_prompt(seq, q, chunked, out, hits)
            waiting.popleft()
            if not chunked:
                num_curr_seqs += 1
            elif self.engine_type == EngineType.NORMAL:  # S24
                break
        out.num_batched_tokens = budget_used
        if self.engine_type == EngineType.NORMAL and not out.scheduled and not out.ignored:
            return None  # S25: the vote decides
        return out

    def _check_fresh(self, seq: Sequence, hits: list[int]) -> AllocStatus:
        """S14: a fresh prompt longer than the limit can never run; else the joint check
        (cached blocks it takes that sit in the free list count against it too)."""
        if len(seq) > self.config.prompt_limit:
            return AllocStatus.NEVER
        needed = self.blocks_needed(seq) - len(hits)
        if hits:
            needed += self.blocks.num_free_among(hits)
        return self._can_allocate_with_state(needed)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Prefix caching: the cached blocks of the longest run of its history's full
        blocks (never the one with its last token), to take when it is scheduled."""
        if not self.caching:
            return []
        bs = self.config.block_size
        n = cacheable_blocks(len(seq), bs)
        if len(seq.block_hashes) < n:
            seq.block_hashes = chain_hashes(seq.token_ids, bs, n, seq.block_hashes)
        return self.blocks.lookup(seq.block_hashes[:n])

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Prefix caching: name each block whose positions are all computed now."""
        bs = self.config.block_size
        full = seq.processed // bs
        if full <= seq.num_registered:
            return
        if len(seq.block_hashes) < full:
            seq.block_hashes = chain_hashes(seq.token_ids, bs, full, seq.block_hashes)
        table, hashes, register = seq.block_table, seq.block_hashes, self.blocks.register
        for i in range(seq.num_registered, full):
            register(table[i], hashes[i])
        seq.num_registered = full

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
            raise RuntimeError(f"prompt of {seq.request_id!r} selected while {seq.status.name}")
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
        out.scheduled.append(ScheduledSequence(seq, q, seqlen_k, not chunked))

    def _take_cached_prefix(self, seq: Sequence, hits: list[int]) -> None:
        bs = self.config.block_size
        self.blocks.take(hits)
        seq.block_table = list(hits)
        seq.num_registered = len(hits)
        seq.processed = len(hits) * bs
        self.num_cache_queried_tokens += len(seq)
        self.num_cache_hit_tokens += seq.processed
        if seq.output_len == 0 and not seq.num_cached_tokens:  # its prompt, not a recompute
            seq.num_cached_tokens = seq.processed

    # ---- the decode path (S26-S29) ----

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
        out.scheduled = rows = [
            ScheduledSequence(seq, 1, seq.processed + seq.in_flight + 1, True) for seq in scheduled
        ]  # S36, before the in-flight counts grow
        for seq in scheduled:
            seq.in_flight += 1
        out.num_batched_tokens = len(rows)
        # Anything the max_num_seqs cap left unvisited stays running, unscheduled.
        self.running = scheduled + running[left:right] if left < right else scheduled
        self.decode_step += 1  # S11
        return out

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

    def _append_slot(self, seq: Sequence) -> None:
        """Grow the table by one block when the next position needs it; shrink a table
        longer than needed (S28)."""
        table = seq.block_table
        bs = self._block_size
        need = (len(seq.token_ids) + seq.in_flight + seq.draft_len + bs - 1) // bs  # S4
        have = len(table)
        if have < need:
            table.append(self.blocks.allocate_one())
        elif have > need:
            self.blocks.free(table[need:])
            del table[need:]

    # ---- preemption (S30) ----

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if seq.status != RUNNING:
            raise RuntimeError(f"preempting {seq.request_id!r} while {seq.status.name}")
        self.num_preemptions += 1
        out.num_preempted += 1
        out.preempted.append(seq)
        stop = self.config.stop_preempted_request
        if stop or seq.so_status != 0:
            why = "stop_preempted_request is set" if stop else (
                f"structured output (so_status {seq.so_status}) cannot be recomputed")
            logger.warning("request %s is preempted and stops: %s", seq.request_id, why)
            seq.status = SequenceStatus.FINISHED_PREEMPTED
            self._retire_into(seq, out.ignored)
            return
        logger.warning("request %s is preempted and will be recomputed", seq.request_id)
        seq.reset_for_recompute()
        self._requeue_preempted(seq)
        seq.status = WAITING
        self._free_resources(seq)

    # ---- processing a step's outputs (S32) ----

    def process_outputs(self, output: SchedulerOutput, sampled_token_ids: list[int | None],
                        fork_tokens: dict[str, list[int]] | None = None) -> StepResult:
        """``fork_tokens``: request id -> the first tokens drawn for its ``forks``, for
        each prompt completed this step that has any (n > 1)."""
        rows = output.scheduled
        if len(sampled_token_ids) != len(rows):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(rows)} scheduled rows")
        result = StepResult()
        if output.kind == StepKind.DECODE:
            self._process_decode(rows, sampled_token_ids, result)
        else:
            self._process_prompt(rows, sampled_token_ids, result, fork_tokens or {})
        result.finished.extend(self._unreported)
        self._unreported.clear()
        return result

    def _process_decode(self, rows, tokens, result: StepResult) -> None:
        append_token = self._append_token
        for row, token in zip(rows, tokens, strict=True):
            seq = row.seq
            if seq.status is WAITING:  # preempted while in flight: stale output (S32)
                continue
            seq.in_flight -= 1
            if seq.status.is_finished:
                self._retire(seq)
                continue
            seq.processed += 1
            if self.caching and seq.processed % self._block_size == 0:
                self._register_full_blocks(seq)
            append_token(seq, token, result)

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
                    raise RuntimeError(f"unfinished prompt {seq.request_id!r} is {seq.status.name}")
                self._requeue_partial(seq)
                continue
            if seq.forks:  # n > 1: the siblings fork from the prompt's KV before its token
                specs, seq.forks = seq.forks, []
                result.forked += self.fork_siblings(seq, specs, fork_tokens[seq.request_id],
                                                    result)
            if self.engine_type != EngineType.PROMPT:
                self.running.append(seq)
            if self._append_token(seq, token, result) and self.engine_type == EngineType.PROMPT:
                # Ownership moves to the engine until it has exported the KV.
                del self._live[seq.request_id]
                result.handed_off.append(seq)

    def _append_token(self, seq: Sequence, token: int | None, result: StepResult) -> bool:
        """Append the sampled token and apply the stop rules in order; True if it goes on."""
        if token is None:
            raise ValueError(f"row of {seq.request_id!r} needs a sampled token")
        history = seq.token_ids
        history.append(token)
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

    # ---- resources ----

    def _admit(self, seq: Sequence) -> None:
        if seq.request_id in self._live:
            raise ValueError(f"request_id {seq.request_id!r} is already scheduled")
        if seq.status != WAITING or seq.retired:
            raise ValueError(f"request {seq.request_id!r} must be new and WAITING, is {seq.status.name}")
        self._live[seq.request_id] = seq

    def _ceil_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _can_allocate_with_state(self, num_blocks: int) -> AllocStatus:
        status = self.blocks.can_allocate(num_blocks)  # S3
        if status is AllocStatus.OK and self.states.num_free == 0:
            return AllocStatus.LATER
        return status

    def _can_allocate_group(self, num_blocks: int, num_states: int) -> AllocStatus:
        if num_states == 1:
            return self._can_allocate_with_state(num_blocks)
        return max(self.blocks.can_allocate(num_blocks), self.states.can_allocate(num_states),
                   key=lambda status: status.value)

    def _partial_blocks(self, num_tokens: int) -> int:
        """1 if the last of ``num_tokens`` positions sits in a partly filled block."""
        return 1 if num_tokens % self.config.block_size else 0

    def _fork_blocks_status(self, seq: Sequence) -> AllocStatus:
        keep = self._ceil_blocks(seq.processed)
        new = self.blocks_needed(seq) - keep + (1 if seq.processed % self.config.block_size else 0)
        return self._can_allocate_with_state(new)

    def _unshare(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Keep the shared full blocks that cover processed positions, copy the partial
        last one, drop the rest and clone the state slot (S15, S27)."""
        table = seq.block_table
        keep = self._ceil_blocks(seq.processed)
        if len(table) > keep:
            self.blocks.free(table[keep:])
            del table[keep:]
        full = seq.processed // self.config.block_size
        if full < keep:
            new = self.blocks.allocate_one()
            out.block_copies.append((table[full], new))
            self.blocks.free_one(table[full])
            table[full] = new
        new_slot = self.states.allocate_one()
        out.state_copies.append((seq.state_slot, new_slot))
        self.states.free_one(seq.state_slot)
        seq.state_slot = new_slot
        seq.fork_pending = False

    def _free_resources(self, seq: Sequence) -> None:
        seq.num_registered = 0
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
        if seq.state_slot != -1:
            self.states.free_one(seq.state_slot)
            seq.state_slot = -1

    def _retire(self, seq: Sequence) -> bool:
        """A finished sequence frees everything it held and is reported, exactly once (S35)."""
        if seq.retired:
            return False
        seq.retired = True
        self._maybe_finished_in_queues = True
        self._free_resources(seq)
        self._live.pop(seq.request_id, None)
        self._unreported.append(seq)
        return True

    def _retire_into(self, seq: Sequence, ignored: list[Sequence]) -> None:
        if self._retire(seq):
            ignored.append(seq)


def decode_priority(seq: Sequence) -> tuple[int, float, int]:
    """Sort key of running before a decode pass (S28): longest output first, ties in
    arrival order. Candidates come from the end of the sorted list, victims from the front."""
    return (seq.prompt_len - len(seq.token_ids), seq.arrival_time, seq.order)
