"""A PROMPT engine's side of the KV hand-off.

Each prompt that completes leaves as one payload for its choices that go on (n > 1:
they share the prompt's KV; the first leads, the others travel as its forks). A
prompt that streams (``stream_kv``) also sends the full blocks each prompt step
completes as payloads of kind "chunk" while the rest of it computes; its hand-off then
leaves those blocks out. Every payload is gathered from the blocks straight into the
buffer the rank's transport lends (``buffer_for(key, nbytes)``): one copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.engine.kv.payload import ForkedChoice, KVPayload, dtype_name, write_payload
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import HandedOffFork, HandOff, KVChunk, TokenLogprobs
from pdserve.scheduler.output import SchedulerOutput, StepKind
from pdserve.scheduler.sequence import Sequence

log = logging.getLogger(__name__)

BufferFor = Callable[[str, int], Any]


def new_payload_buffer(attempt: str, nbytes: int) -> bytearray:
    return bytearray(nbytes)


def handoff_groups(handed_off: list[Sequence]) -> list[list[Sequence]]:
    """Handed-off sequences by the prompt they share (a fork with its parent), the
    parent first when it goes on too."""
    groups: dict[str, list[Sequence]] = {}
    for seq in handed_off:
        groups.setdefault(seq.fork_of or seq.attempt, []).append(seq)
    return [sorted(g, key=lambda seq: seq.fork_of is not None) for g in groups.values()]


@dataclass
class Stream:
    """A prompt whose KV goes ahead in chunks as it computes."""

    prompt: list[int]
    sent: int = 0  # full blocks streamed so far


class KVExport:
    def __init__(self, runner: ModelRunner, block_size: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self.streamed: dict[str, Stream] = {}  # by attempt, until its hand-off

    def stream(self, attempt: str, prompt: list[int]) -> None:
        """Stream ``attempt``'s prompt KV ahead in chunks as it computes."""
        self.streamed[attempt] = Stream(list(prompt))

    def forget_ended(self, live: Container[str]) -> None:
        """Requests that ended before their hand-off stream no more."""
        self.streamed = {k: s for k, s in self.streamed.items() if k in live}

    def stream_ahead(self, sched_out: SchedulerOutput, ended: Container[str],
                     buffer_for: BufferFor) -> list[KVChunk]:
        """Chunks of the full blocks this prompt step completed, for streaming prompts
        that are not done yet (a done one hands its remaining blocks off; one that
        ``ended`` this step streams no more)."""
        if sched_out.kind != StepKind.PROMPT:
            return []
        chunks, block_size = [], self.block_size
        for row in sched_out.scheduled:
            stream = self.streamed.get(row.attempt)
            # the step computed its positions up to seqlen_k (one step at a time)
            if stream is None or row.attempt in ended or row.seqlen_k >= len(stream.prompt):
                continue
            sent, full = stream.sent, row.seqlen_k // block_size
            if full <= sent:
                continue
            key = f"{row.attempt}/kv{sent}"
            chunk = self._payload(
                attempt=key, token_ids=stream.prompt[:full * block_size],
                num_prompt_tokens=full * block_size, sampling={}, skipped_blocks=sent,
                kind="chunk", stream_of=row.attempt)
            try:
                buffer = write_payload(chunk, self.runner, list(row.block_table),
                                       row.state_slot, full * block_size, buffer_for, key,
                                       sent)
            except Exception as exc:  # what went ahead stays needed; the rest goes at hand-off
                log.warning("streaming KV of %s stopped: %s: %s", row.attempt,
                            type(exc).__name__, exc)
                continue
            stream.sent = full
            chunks.append(KVChunk(row.attempt, key, sent, full - sent, buffer))
        return chunks

    def hand_off(self, group: list[Sequence], buffer_for: BufferFor,
                 logprobs: dict[str, TokenLogprobs]) -> HandOff:
        """One payload for the choices of one prompt that go on, and its record;
        ``logprobs``: this step's, of the choices that asked."""
        seq, others = group[0], group[1:]
        stream_of = seq.fork_of or seq.attempt  # a fork leads when its parent stopped
        stream = self.streamed.pop(stream_of, None)
        streamed = stream.sent if stream is not None else 0
        payload = self._payload(
            attempt=seq.attempt, token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.prompt_len, sampling=asdict(seq.sampling),
            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
            forks=[ForkedChoice(o.attempt, o.token_ids[-1], asdict(o.sampling))
                   for o in others],
            skipped_blocks=streamed, stream_of=stream_of if streamed else "")
        buffer = write_payload(payload, self.runner, seq.block_table, seq.state_slot,
                               seq.prompt_len, buffer_for, seq.attempt, streamed)
        return HandOff(seq.attempt, seq.token_ids[-1], buffer, seq.prompt_len,
                       arrival_time=seq.arrival_time,
                       first_scheduled_time=seq.first_scheduled_time,
                       first_token_time=seq.first_token_time,
                       first_token_logprobs=logprobs.get(seq.attempt),
                       forks=[HandedOffFork(o.attempt, o.token_ids[-1],
                                            logprobs.get(o.attempt))
                              for o in others],
                       num_cached_tokens=seq.num_cached_tokens,
                       streamed_blocks=streamed, stream_of=stream_of if streamed else "")

    def _payload(self, **fields: Any) -> KVPayload:
        """A payload stamped with what the receiver checks: this engine's model, dtype,
        block size and layer count."""
        runner = self.runner
        return KVPayload(model_fingerprint=runner.model_fingerprint,
                         dtype=dtype_name(runner.kv_cache.dtype), block_size=self.block_size,
                         num_layers=runner.num_layers, **fields)
