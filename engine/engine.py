"""One engine rank: a scheduler bound to a model runner.

A request's life inside an engine:

1. NORMAL / PROMPT: `add_request` wraps the prompt in a Sequence and queues it in
   the scheduler's `waiting`. COMPLETION: `import_prefilled` checks a KV payload,
   queues it until blocks are free, then writes its KV into fresh blocks and
   queues it in `prompted`.
   n > 1: `add_request(..., forks=...)` names the other choices; they fork from the
   prompt's KV when it completes (S34), each with its own first token drawn from the
   same logits. A PROMPT engine hands all of them off in one payload; the COMPLETION
   engine imports it once and forks them again.
   KV streaming (``stream_kv``): a PROMPT engine exports the full blocks each prompt
   chunk completes as a payload of kind "chunk" (``StepOutputs.kv_chunks``) while the
   rest of the prompt computes; the COMPLETION engine writes each chunk into blocks it
   reserves for the request (a partial import), and the hand-off's payload then leaves
   those blocks out.
2. `step()`: schedule -> run the model on the scheduled rows (or nothing, for an
   empty step) -> process outputs -> report per-request outputs.
3. A PROMPT engine exports each completed prompt as a KV payload (a HandOff) and
   frees its blocks; the first sampled token travels with the payload.
4. Every request ends with exactly one finish reason, and every block and state
   slot it held is free again (`assert_drained` on an idle engine).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from pdserve.engine.attempts import Attempts, Place
from pdserve.engine.config import EngineConfig
from pdserve.engine.errors import CacheMissError, NoCapacityError
from pdserve.engine.guided.requests import GuidedRequests
from pdserve.engine.kv.export import KVExport, handoff_groups, new_payload_buffer
from pdserve.engine.kv.partial_imports import PartialImports
from pdserve.engine.kv.payload import KVPayload, KVPayloadError, dtype_name
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import EngineStats, HandOff, KVCapacity, RequestOutput, StepOutputs
from pdserve.engine.request_outputs import (
    engine_stats,
    request_outputs,
    split_fork_draws,
)
from pdserve.engine.speculative.decoding import make_speculator
from pdserve.engine.step_inputs import runner_rows
from pdserve.scheduler.block_pool import AllocStatus
from pdserve.scheduler.config import EngineType
from pdserve.scheduler.output import SchedulerOutput, StepKind, StepResult
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.sequence import Sequence
from pdserve.scheduler.votes import Communicator

log = logging.getLogger(__name__)


# A partial import nobody continued for this long frees its blocks (its router or
# prefill rank is gone; a live stream sends its next chunk or its hand-off sooner).
PARTIAL_IMPORT_MAX_AGE_S = 120.0


class LLMEngine:
    def __init__(self, config: EngineConfig, communicator: Communicator | None = None,
                 runner: ModelRunner | None = None) -> None:
        self.config = config
        self.engine_type = config.type
        self.runner = runner or ModelRunner.from_engine_config(config)
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = config.max_model_len or self.runner.max_model_len
        sched_config = config.scheduler_config(
            num_blocks=self.runner.num_kv_blocks, max_model_len=self.max_model_len,
            ring_len=self.runner.ring_len,
            has_ring_layers=self.runner.sliding_window)
        self.scheduler = Scheduler(sched_config, self.engine_type, communicator)
        self.rank = communicator.rank if communicator is not None else 0
        self.attempts = Attempts()  # where each attempt here is (engine/attempts.py)
        self._pending_imports: collections.deque[KVPayload] = collections.deque()
        # aborted before they had a sequence (a queued import, a fork not made yet):
        # reported next step
        self._aborted_unstarted: list[str] = []
        self.num_steps = 0
        self.num_empty_steps = 0
        self.num_failed_steps = 0
        # attempt -> why its step failed: reported once as finish "error".
        self._failed: dict[str, str] = {}
        # attempt -> logprobs of the token it drew this step (only requests that asked).
        self._step_logprobs: dict = {}
        self._draw_logprobs: list | None = None  # this step's draws' (rows, then forks)
        # (attempt, nbytes) -> a writable buffer a hand-off's payload is written into:
        # the rank's KV transport lends its own (shared memory) so that the blocks are
        # gathered straight into the bytes it hands over
        self.payload_buffer: Callable[[str, int], Any] = new_payload_buffer
        self._export = KVExport(self.runner, config.block_size)  # PROMPT
        self._partial = PartialImports(self.scheduler, self.runner,  # COMPLETION
                                       config.block_size)
        # structured output and the other logits controls (engine/guided/requests.py)
        self.guided = GuidedRequests(self.tokenizer, self.runner.vocab_size)
        self.scheduler.token_check = self.guided.accept
        self.speculator = make_speculator(config, self.runner, self.max_model_len)

    # -- admission -------------------------------------------------------------------

    def add_request(self, attempt: str, prompt_token_ids: list[int],
                    sampling: SamplingParams, arrival_time: float | None = None,
                    forks: list[tuple[str, SamplingParams]] | tuple = (),
                    stream_kv: bool = False, moved: bool = False) -> None:
        """``forks``: (attempt, sampling) of each further choice of the same prompt
        (n > 1), prefilled once with this one. ``stream_kv`` (PROMPT): stream the
        prompt's KV ahead in chunks as it computes (not for sliding-window models).
        ``moved``: it was moved here off another rank; it queues ahead of new arrivals."""
        if self.engine_type == EngineType.COMPLETION:
            raise TypeError("a COMPLETION engine takes prefilled requests (import_prefilled)")
        self.attempts.check_new([attempt, *(fork_id for fork_id, _ in forks)])
        self._check_tokens(prompt_token_ids, sampling)
        for _, fork_sampling in forks:
            fork_sampling.validate()
        seq = Sequence(attempt, prompt_token_ids, sampling, arrival_time=arrival_time,
                       eos_token_id=self.tokenizer.eos_token_id, forks=forks, moved=moved)
        if stream_kv and self.engine_type == EngineType.PROMPT \
                and not self.runner.sliding_window:
            self._export.stream(attempt, prompt_token_ids)
        for fork_id, _ in forks:
            self.attempts.put(fork_id, Place.FORK, seq)
        if sampling.guide is None:
            self._schedule(seq)
            return
        self.attempts.put(attempt, Place.GRAMMAR, seq)
        self.guided.admit_or_park(attempt, sampling.guide, lambda: self._schedule(seq),
                                  lambda cause: self._fail_unstarted(seq, cause))

    def _schedule(self, seq: Sequence) -> None:
        self.attempts.put(seq.attempt, Place.SCHEDULER, seq)
        self.scheduler.add(seq)

    def _fail_unstarted(self, seq: Sequence, cause: str) -> None:
        """End a request that never ran with ``error`` (and its forks with it)."""
        self._schedule(seq)
        self._failed[seq.attempt] = cause
        self.scheduler.abort(seq.attempt)

    def import_prefilled(self, data: Any, *, borrowed: bool = False,
                         skip_blocks: int = 0) -> str:
        """Check a payload completely, then queue it until its blocks can be allocated;
        one that finds room is written into its blocks at once.

        ``data``: the payload's bytes (its tensors stay views of them) or a KVPayload.
        ``borrowed``: the bytes are the sender's and may be reused once this returns, so
        a payload that must wait for room takes a copy of its tensors first.
        ``skip_blocks``: leave out the first full blocks, which this engine's prefix
        cache holds (the receiver's side of a cut)."""
        if self.engine_type != EngineType.COMPLETION:
            raise TypeError("only a COMPLETION engine imports prefilled requests")
        payload = data if isinstance(data, KVPayload) else KVPayload.from_bytes(
            data, vocab_size=self.runner.vocab_size)
        if skip_blocks:
            payload = payload.without_prefix(skip_blocks)
        payload.check_compatible(
            model_fingerprint=self.runner.model_fingerprint, dtype=dtype_name(self.runner.kv_cache.dtype),
            block_size=self.config.block_size, num_layers=self.runner.num_layers)
        if payload.kind == "chunk":
            return self._import_chunk(payload)
        ids = [payload.attempt, *(fork.attempt for fork in payload.forks)]
        self.attempts.check_new(ids)
        skipped = payload.skipped_blocks
        if self.scheduler.can_admit_prefilled(payload.num_prompt_tokens, len(payload.forks),
                                              skipped) == AllocStatus.NEVER:
            raise NoCapacityError(
                f"request {payload.attempt!r} needs more KV blocks or state slots "
                f"(with its {len(payload.forks)} forks) than this engine has")
        payload.sampling = _payload_sampling(payload.sampling, "sampling")  # type: ignore[assignment]
        for i, fork in enumerate(payload.forks):
            fork.sampling = _payload_sampling(fork.sampling, f"forks[{i}].sampling")
        if payload.sampling.guide is not None:  # compiled while it waits for its turn
            self.guided.book.request(payload.sampling.guide)
        self.runner.check_kv_import(payload.tensors, payload.num_prompt_tokens, skipped)
        if skipped:  # the prefix it left out must be here (streamed or cached): held from now
            payload.cached_block_ids = self._take_skipped_prefix(payload)
        for attempt in ids:
            self.attempts.put(attempt, Place.IMPORT, payload=payload)
        self._pending_imports.append(payload)
        self._admit_imports()
        if borrowed and any(p is payload for p in self._pending_imports):
            payload.tensors = {name: t.clone() for name, t in payload.tensors.items()}
        return payload.attempt

    def _take_skipped_prefix(self, payload: KVPayload) -> list[int]:
        """The blocks of a payload's left-out prefix: its chunks' (a partial import), or
        this engine's prefix cache's; referenced from now on."""
        skipped, prompt = payload.skipped_blocks, payload.token_ids[:payload.num_prompt_tokens]
        held = self._partial.take_prefix(payload, prompt)
        if held is None:
            held = self.scheduler.take_cached_prefix(prompt, skipped)
        if held is None:
            raise CacheMissError(
                f"request {payload.attempt!r} left out {skipped} blocks of KV this engine "
                "holds neither from streamed chunks nor in its prefix cache: send them")
        return held

    def _import_chunk(self, chunk: KVPayload) -> str:
        """Write a streamed chunk into blocks reserved for its request, in order."""
        if self.runner.sliding_window:
            raise KVPayloadError("a sliding-window model takes no streamed KV chunks")
        self._partial.add_chunk(chunk, self.attempts)
        return chunk.attempt

    def _expire_partials(self) -> None:
        for stream_of in self._partial.expired(PARTIAL_IMPORT_MAX_AGE_S):
            log.warning("streamed KV of %s expired: no hand-off followed its chunks", stream_of)
            self._partial.drop(stream_of)

    def abort(self, attempt: str) -> bool:
        """Abort wherever it is (one lookup; its streamed KV, held apart, goes too).
        False if this engine holds nothing of it."""
        dropped = self._partial.drop(attempt)
        held = self.attempts.get(attempt)
        if held is None:
            return dropped
        if held.place == Place.SCHEDULER:
            self.scheduler.abort(attempt)
        elif held.place == Place.GRAMMAR:
            self.guided.unpark(attempt)
            self._abort_unstarted(held.seq)
        elif held.place == Place.FORK:  # it never will be forked
            held.seq.drop_forks(attempt)
            self._end_unstarted(attempt)
        elif held.place == Place.IMPORT:
            self._abort_import(attempt, held.payload)
        return True

    def _abort_import(self, attempt: str, payload: KVPayload) -> None:
        if attempt != payload.attempt:  # a fork of a queued payload
            payload.forks = [f for f in payload.forks if f.attempt != attempt]
            self._end_unstarted(attempt)
            return
        # by identity: payloads hold tensors, which do not compare as plain values
        i = next(i for i, p in enumerate(self._pending_imports) if p is payload)
        if payload.forks:  # the next choice takes the payload's lead
            lead = self._pending_imports[i] = payload.without_lead()
            for choice in (lead.attempt, *(fork.attempt for fork in lead.forks)):
                self.attempts.put(choice, Place.IMPORT, payload=lead)
        else:
            del self._pending_imports[i]
            self.scheduler.release_blocks(payload.cached_block_ids)
        self._end_unstarted(attempt)

    def _abort_unstarted(self, seq: Sequence) -> None:
        for attempt in (seq.attempt, *(fork_id for fork_id, _ in seq.forks)):
            self._end_unstarted(attempt)
        seq.drop_forks()

    def _end_unstarted(self, attempt: str) -> None:
        """Reported as aborted at the next step."""
        self.attempts.put(attempt, Place.ENDED)
        self._aborted_unstarted.append(attempt)

    # -- the step --------------------------------------------------------------------

    def step(self) -> StepOutputs:
        """schedule -> run -> process outputs, as a transaction: if the model run (or a
        KV import or export) raises, every sequence it took ends with ``error`` naming
        the cause (``step_failed``: the router may move it) and frees its blocks and
        state slot; the exception does not escape. A failure in the scheduler itself
        (a collective timing out, a broken invariant) does escape: the rank's group
        must re-form."""
        started = time.perf_counter()
        if self._partial:
            self._expire_partials()
        self.guided.admit_ready()
        self._admit_imports()
        if self.speculator is not None:
            self.scheduler.set_drafts(self.speculator.propose(self.scheduler.running,
                                                              self.guided.fitting_draft))
        sched_out = self.scheduler.schedule()
        run_started = time.perf_counter()
        self._step_logprobs = {}
        self._draw_logprobs = None
        try:
            sampled = self._execute(sched_out)
        except Exception as exc:
            sampled = self._abandon(sched_out, exc)
        else:
            if sched_out.kind == StepKind.PROMPT and sched_out.scheduled:
                self.scheduler.observe_prompt_step(sched_out, time.perf_counter() - run_started)
        sampled, fork_tokens = split_fork_draws(sched_out, sampled, self._draw_logprobs,
                                                self._step_logprobs)
        result = self.scheduler.process_outputs(sched_out, sampled, fork_tokens)
        for child in result.forked:
            self.attempts.put(child.attempt, Place.SCHEDULER, child)
        kv_chunks = self._export.stream_ahead(
            sched_out, {seq.attempt for seq in result.finished}, self.payload_buffer) \
            if self._export.streamed else []
        handoffs = self._hand_off_all(result)
        outputs = self._collect_outputs(result)
        if self._export.streamed:
            self._export.forget_ended(self.attempts)
        self.num_steps += 1
        if sched_out.is_empty:
            self.num_empty_steps += 1
        return StepOutputs(kind=_KIND_NAMES[sched_out.kind], outputs=outputs, handoffs=handoffs,
                           num_scheduled_tokens=sched_out.num_tokens,
                           duration_s=time.perf_counter() - started,
                           num_rows=len(sched_out.scheduled),
                           cache_events=self.scheduler.cache_events(), kv_chunks=kv_chunks)

    def _abandon(self, sched_out: SchedulerOutput, exc: BaseException) -> list[int]:
        """The model run failed: abort every scheduled sequence so that processing the
        step retires them (frees blocks and slots, reports them once)."""
        self.num_failed_steps += 1
        cause = f"step failed on rank {self.rank}: {type(exc).__name__}: {exc}"
        log.error("%s (%d rows)", cause, len(sched_out.scheduled))
        for row in sched_out.scheduled:
            self._failed[row.attempt] = cause
            self.scheduler.abort(row.attempt)
        return [0] * len(sched_out.scheduled)  # ignored: every row is finished now

    def _fail_handoff(self, group: list[Sequence], exc: BaseException,
                      result: StepResult) -> None:
        cause = f"KV export failed on rank {self.rank}: {type(exc).__name__}: {exc}"
        log.error("%s (request %s)", cause, group[0].attempt)
        for seq in group:
            self.scheduler.release_handed_off(seq)
            self._failed[seq.attempt] = cause
            result.handed_off.remove(seq)
            result.finished.append(seq)

    def _execute(self, sched_out: SchedulerOutput) -> list[int | None]:
        # before the model writes anything; a step with no rows may still carry the
        # copies of forks made by the step before it
        self.runner.copy_kv(sched_out.block_copies, sched_out.state_copies)
        if sched_out.is_empty:
            return []
        rows, spans = runner_rows(sched_out.scheduled, self.guided.controls_for)
        spec = self.speculator if sched_out.kind == StepKind.DECODE else None
        if spec is not None:
            spec.step_started()
        tokens, logprobs = self.runner.execute_with_logprobs(rows)
        if spec is not None:
            spec.step_done(len(rows))
        if spans is not None:  # drafts verified: each drafted row emits a list
            tokens, per_row = spec.fold(sched_out.scheduled, spans, tokens, logprobs)
        else:
            per_row = logprobs and [None if lp is None else [lp] for lp in logprobs]
        if per_row is not None:  # some row asked (sampling.logprobs): keyed for the outputs
            self._step_logprobs = {row.attempt: lps for row, lps in
                                   zip(sched_out.scheduled, per_row, strict=False) if lps}
            self._draw_logprobs = logprobs  # the forks' draws follow the rows
        return tokens

    def _collect_outputs(self, result: StepResult) -> list[RequestOutput]:
        outputs, ended = request_outputs(result, self._step_logprobs, self._failed,
                                         self._aborted_unstarted)
        self._aborted_unstarted.clear()
        for attempt in ended:
            self.guided.forget(attempt)
            if self.speculator is not None:
                self.speculator.forget(attempt)
            self.attempts.forget(attempt)  # the forks of a prompt that ended too
        return outputs

    # -- KV hand-off -----------------------------------------------------------------

    def _hand_off_all(self, result: StepResult) -> list[HandOff]:
        """A hand-off for each prompt handed off this step; one whose export fails ends
        with ``error`` (its blocks back) and the others go on."""
        handoffs = []
        for group in handoff_groups(result.handed_off):
            try:
                handoffs.append(self._hand_off(group))
            except Exception as exc:
                self._fail_handoff(group, exc, result)
        return handoffs

    def _hand_off(self, group: list[Sequence]) -> HandOff:
        """Export the choices of one prompt that go on; their blocks go back."""
        handoff = self._export.hand_off(group, self.payload_buffer,
                                        {k: v[0] for k, v in self._step_logprobs.items()})
        for member in group:
            self.scheduler.release_handed_off(member)
            self.attempts.forget(member.attempt)
            self.guided.forget(member.attempt)
        return handoff

    def _admit_imports(self) -> None:
        while self._pending_imports:
            payload = self._pending_imports[0]
            guide = payload.sampling.guide
            if guide is not None and not self.guided.book.ready(guide):
                return  # FIFO: the imports behind it wait for its grammar
            if self.scheduler.can_admit_prefilled(
                    payload.num_prompt_tokens, len(payload.forks),
                    len(payload.cached_block_ids)) != AllocStatus.OK:
                return  # FIFO: later imports wait behind the head, as prompts do
            self._pending_imports.popleft()
            seq = Sequence(payload.attempt, payload.token_ids[:payload.num_prompt_tokens],
                           payload.sampling, arrival_time=payload.arrival_time,
                           eos_token_id=self.tokenizer.eos_token_id)
            group = self.scheduler.admit_imported(
                seq, payload.first_token_id, payload.first_token_time, payload.cached_block_ids,
                payload.cached_block_hashes, [(f.attempt, f.sampling) for f in payload.forks],
                [f.first_token_id for f in payload.forks])
            for member in group:
                self.attempts.put(member.attempt, Place.SCHEDULER, member)
            try:
                self.runner.import_kv(seq.block_table[payload.skipped_blocks:], seq.state_slot,
                                      payload.tensors)
                self.scheduler.register_prefilled(seq)
            except Exception as exc:  # their blocks go back when the next pass sweeps them
                cause = f"KV import failed on rank {self.rank}: {type(exc).__name__}: {exc}"
                log.error("%s (request %s)", cause, seq.attempt)
                for member in group:
                    self._failed[member.attempt] = cause
                    self.scheduler.abort(member.attempt)

    # -- checks and state ------------------------------------------------------------

    def _check_tokens(self, token_ids: list[int], sampling: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.runner.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids holds {bad}, outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids has {len(token_ids)} tokens; the model allows at most "
                f"{self.max_model_len - 1} so one can be generated")
        sampling.validate()
        named = [t for t, _ in sampling.logit_bias] + [
            t for word in sampling.bad_words_token_ids for t in word]
        if any(t >= vocab for t in named):
            raise ValueError(f"logit_bias and bad_words name token ids outside the "
                             f"vocabulary [0, {vocab})")

    @property
    def num_pending_imports(self) -> int:
        return len(self._pending_imports)

    def has_work(self) -> bool:
        return bool(self._pending_imports or self._aborted_unstarted or self.guided.num_parked
                    or self.scheduler.has_unfinished())

    def assert_drained(self) -> None:
        assert not self.has_work(), "engine still has work"
        assert not self.attempts, f"attempts still held: {sorted(self.attempts)}"
        assert not self._partial, f"streamed KV never imported: {sorted(self._partial)}"
        assert not self.guided.num_parked and not self.guided.num_matchers, \
            "guided requests still waiting or matched"
        assert not self._export.streamed, \
            f"streams never handed off: {sorted(self._export.streamed)}"
        self.scheduler.assert_drained()

    def stats(self) -> EngineStats:
        return engine_stats(self)

    def kv_capacity(self) -> KVCapacity:
        return self.runner.kv_capacity(self.max_model_len)


def _payload_sampling(settings: dict, where: str) -> SamplingParams:
    try:
        return SamplingParams(**settings)
    except (TypeError, ValueError) as exc:
        raise KVPayloadError(f"KV payload {where} settings are invalid: {exc}") from exc


_KIND_NAMES = {StepKind.PROMPT: "prompt", StepKind.DECODE: "decode",
               StepKind.EMPTY_PROMPT: "empty_prompt"}
