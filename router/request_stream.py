"""One admitted request's output as both fronts (gRPC, HTTP) stream it.

1. The front validates (``validation.prepare``) and admits (``RouterService.admit``).
2. ``stream_chunks`` turns the request's events into ``Chunk``s: tokens, their text
   (``text_output.TextOutput``: detokenized, stop strings held back and matched), their
   logprobs, and a last chunk with the finish reason.
3. A stop string ends the request at once on its ranks (finish reason "stop"), so its
   blocks free while the client reads the last chunk.
4. However the consumer leaves (done, client gone, deadline, an exception), the
   request ends exactly once, its metrics are recorded and its identity released.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.router.text_output import TextOutput


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list | None = None  # aligned with token_ids, when the request asked
    finish_reason: str | None = None
    error: str | None = None
    num_completion_tokens: int = 0  # on the last chunk: tokens the client received


async def stream_chunks(svc, state) -> AsyncIterator[Chunk]:
    prepared = state.request
    out = TextOutput(svc.tokenizer, prepared.prompt_token_ids, prepared.stop,
                     prepared.include_stop_str_in_output)
    sent_tokens = 0
    clock = _TokenClock(svc, state)
    try:
        while True:
            event = await state.events.get()
            if event.token_ids:
                clock.tokens_arrived()
            delta = out.push(event.token_ids)
            logprobs = event.logprobs  # aligned with the event's tokens, when asked for
            if logprobs is not None:
                logprobs = logprobs[:len(delta.token_ids)]
            sent_tokens += len(delta.token_ids)
            if delta.stopped:
                # ended at once; the aborts on its ranks run in the service's tasks
                svc.end_now(state, f"stop string {delta.stop_str!r}", finish_reason="stop")
                yield Chunk(delta.token_ids, delta.text, logprobs, "stop",
                            num_completion_tokens=sent_tokens)
                return
            if event.finish_reason is None:
                if delta.token_ids or delta.text:
                    yield Chunk(delta.token_ids, delta.text, logprobs)
                continue
            rest = out.flush()
            if rest.stopped:  # the held-back tail held a match after all
                yield Chunk(delta.token_ids, delta.text + rest.text, logprobs, "stop",
                            num_completion_tokens=sent_tokens)
                return
            yield Chunk(delta.token_ids, delta.text + rest.text, logprobs,
                        event.finish_reason, event.error, num_completion_tokens=sent_tokens)
            return
    finally:
        # Nothing here awaits: a consumer cancelled more than once (an HTTP stream torn
        # down) must still end the request, count it and release it.
        if not state.finished:  # client gone or deadline passed: abort wherever it is
            svc.end_now(state, "client disconnected or deadline exceeded")  # aborts: tasks
        svc.metrics.request_finished(state, time.monotonic())
        svc.tracker.release(state.rid)


class _TokenClock:
    """A stream's token timing: each gap between chunks is an inter-token sample (the
    metrics' and the planner's), the first chunk the planner's recent TTFT."""

    def __init__(self, svc, state) -> None:
        self.svc, self.state = svc, state
        self.last_chunk: float | None = None

    def tokens_arrived(self) -> None:
        svc, state, now = self.svc, self.state, time.monotonic()
        if self.last_chunk is not None:
            svc.metrics.inter_token(now - self.last_chunk)
            _note(svc.latencies.itl, now, now - self.last_chunk, state.decode_rank)
        elif state.first_token_at is not None:  # the planner's recent TTFT
            _note(svc.latencies.ttft, now, state.first_token_at - state.created,
                  state.prefill_rank or state.decode_rank)
        self.last_chunk = now


def _note(window, now: float, seconds: float, rank) -> None:
    """A sample, tagged with the rank that produced it (None: unknown)."""
    if rank is None:
        window.add(now, seconds)
    else:
        window.add(now, seconds, rank.pool, rank.uid)


async def merged_chunks(svc, states: list) -> AsyncIterator[tuple[int, Chunk]]:
    """(index in ``states``, chunk) of several requests' streams (n choices, several
    prompts), as they come; every stream is ended when the consumer leaves early
    (stream_chunks' own cleanup)."""
    if len(states) == 1:  # one stream: no pump task, no queue hop per chunk
        async with contextlib.aclosing(stream_chunks(svc, states[0])) as chunks:
            async for chunk in chunks:
                yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, state):
        try:
            async for chunk in stream_chunks(svc, state):
                await queue.put((i, chunk))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
