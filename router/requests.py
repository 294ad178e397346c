"""Requests the router has in flight: where each one is, and its event queue."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from pdserve.router.validation import PreparedRequest, RequestError

# Stages a request passes through; "done" once its finish event is queued.
QUEUED, PREFILL, HANDOFF, DECODE, DONE = "queued", "prefill", "handoff", "decode", "done"
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Event:
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class RequestState:
    request: PreparedRequest
    stage: str = QUEUED
    prefill_rank: Any = None
    decode_rank: Any = None
    tokens: list[int] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    aborted: bool = False
    finish_reason: str | None = None
    error: str | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    attempts: int = 0
    # Tokens the current attempt produced; a retried attempt replays the ones already
    # streamed (checked, not re-sent) before streaming new ones.
    attempt_tokens: int = 0
    # When it was first sent to a rank, and the durations (seconds, each on one host's
    # clock) the ranks and the router measured of it: GenerateResponse.timings.
    dispatched_at: float | None = None
    timings: dict = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.stage == DONE

    def _fresh(self, token_ids: list[int]) -> list[int] | None:
        """The part of this attempt's tokens not streamed yet (None: a replay diverged)."""
        fresh = []
        for t in token_ids:
            i = self.attempt_tokens
            self.attempt_tokens += 1
            if i < len(self.tokens):
                if self.tokens[i] != t:
                    return None
            else:
                fresh.append(int(t))
        return fresh

    def push(self, token_ids: list[int]) -> None:
        if self.finished or not token_ids:
            return
        fresh = self._fresh(token_ids)
        if fresh is None:
            self.finish("error", "a re-prefilled attempt diverged from the tokens already streamed")
            return
        if not fresh:
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.tokens.extend(fresh)
        self.events.put_nowait(Event(fresh))

    def finish(self, reason: str, error: str | None = None, token_ids: list[int] | None = None) -> bool:
        """Queue the last event; only the first call counts."""
        if self.finished:
            return False
        if reason not in FINISH_REASONS:
            error = error or reason
            reason = "error"
        fresh = self._fresh(token_ids or []) if reason != "error" else []
        if fresh is None:
            reason, error, fresh = "error", "a re-prefilled attempt diverged from the tokens already streamed", []
        self.tokens.extend(fresh)
        self.stage = DONE
        self.finish_reason, self.error = reason, error
        self.events.put_nowait(Event(fresh, reason, error))
        return True

    @property
    def replayable(self) -> bool:
        """Can a new attempt reproduce the streamed tokens (greedy, or seeded)?"""
        s = self.request.sampling
        return s.temperature == 0 or s.seed is not None


class RequestTracker:
    """In-flight requests by id, plus the ids aborted before their Generate arrived.

    A client that sends ``Abort`` right after starting ``Generate`` on another stream
    can be ahead of it; the abort must not be lost. An unknown id is remembered for
    ``early_abort_ttl_s`` (at most ``max_early_aborts`` ids, oldest dropped first), and
    a request registered with a remembered id ends at once with "abort"."""

    def __init__(self, max_queue_depth: int, early_abort_ttl_s: float = 60.0,
                 max_early_aborts: int = 4096) -> None:
        self.max_queue_depth = max_queue_depth
        self.early_abort_ttl_s = early_abort_ttl_s
        self.max_early_aborts = max_early_aborts
        self._early_aborts: dict[str, float] = {}  # id -> expiry (monotonic), oldest first
        self._states: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.num_finished = 0

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def states(self) -> list[RequestState]:
        return list(self._states.values())

    def register(self, request: PreparedRequest) -> RequestState:
        if not request.request_id:
            request.request_id = f"req-{self._prefix}-{next(self._ids)}"
        elif request.request_id in self._states:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {request.request_id!r} is already in flight")
        if len(self._states) >= self.max_queue_depth:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the router has {len(self._states)} requests in flight "
                f"(max_queue_depth {self.max_queue_depth}); retry later")
        state = RequestState(request)
        self._states[request.request_id] = state
        return state

    def remember_early_abort(self, request_id: str) -> None:
        if not request_id:
            return
        now = time.monotonic()
        self._early_aborts.pop(request_id, None)
        self._early_aborts[request_id] = now + self.early_abort_ttl_s
        self._drop_expired(now)
        while len(self._early_aborts) > self.max_early_aborts:
            del self._early_aborts[next(iter(self._early_aborts))]

    def take_early_abort(self, request_id: str) -> bool:
        """Was ``request_id`` aborted before it arrived (and not long ago)? Forgets it."""
        self._drop_expired(time.monotonic())
        return self._early_aborts.pop(request_id, None) is not None

    def _drop_expired(self, now: float) -> None:
        while self._early_aborts:
            oldest = next(iter(self._early_aborts))
            if self._early_aborts[oldest] > now:
                return
            del self._early_aborts[oldest]

    def release(self, request_id: str) -> None:
        if self._states.pop(request_id, None) is not None:
            self.num_finished += 1
