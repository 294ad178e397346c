"""Requests the router has in flight: identity, where each one is, its event queue.

Identity: every request gets an internal id (random, 96 bits) that no client can
choose or predict, and every dispatch of it an attempt number; engines only ever see
the attempt key (`rank.messages.AttemptKey`). The client's `request_id` is a label:
unique among the requests in flight, echoed back, and free again the moment its
request ended for the client. A report from an attempt that is no longer current is
dropped. Labels belong to a tenant (the token that sent the request): one tenant's
labels, duplicate checks and Aborts never see another's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.rank.messages import AddRequest, AttemptKey
from pdserve.router.request_error import RequestError
from pdserve.router.validation import PreparedRequest

# Stages a request passes through; "done" once its finish event is queued.
QUEUED, PREFILL, HANDOFF, DECODE, DONE = "queued", "prefill", "handoff", "decode", "done"
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Event:
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    # One TokenLogprobs (rank/messages.py) per token_ids entry when the request asked
    # for logprobs, else None.
    logprobs: list | None = None


@dataclass(eq=False)  # identity: choices refer to each other (siblings)
class RequestState:
    request: PreparedRequest
    rid: str  # internal id
    label: str  # the client's request_id, or the internal id when it gave none
    label_chosen: bool = False
    tenant: str = ""  # whose token sent it: labels and Abort are per tenant
    stage: str = QUEUED
    prefill_rank: Any = None
    decode_rank: Any = None
    tokens: list[int] = field(default_factory=list)  # streamed to the client, in order
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    aborted: bool = False
    finish_reason: str | None = None
    error: str | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    attempt: int = 0  # the current attempt's number (0: none yet)
    attempt_tokens: int = 0  # tokens the current attempt produced so far
    num_moves: int = 0  # attempts started because a rank died, left or failed
    outstanding: int = 0  # prompt tokens the current attempt asked its entry rank for
    progress_at: float = field(default_factory=time.monotonic)  # attempt began / last token
    error_hint: str = ""  # why the last attempt ended early, for a final error
    # When it was first sent to a rank, and the durations (seconds, each on one host's
    # clock) the ranks and the router measured of it: GenerateResponse.timings.
    dispatched_at: float | None = None
    timings: dict = field(default_factory=dict)
    on_finish: Callable[[RequestState], None] | None = None
    client_gone: Callable[[], bool] | None = None  # the caller's stream is cancelled
    # n > 1: which choice this is, and every choice of its prompt (itself included, the
    # lead first; empty for n = 1). A choice that ``joins_lead`` is prefilled with the
    # lead (one prompt step, one hand-off) rather than on its own.
    choice: int = 0
    siblings: list[RequestState] = field(default_factory=list)
    joins_lead: bool = False
    # The choices sharing its KV hand-off in flight (n > 1), while it is in HANDOFF.
    handoff_group: list[RequestState] | None = None
    cached_tokens: int = 0  # prompt tokens its prefill took from a rank's prefix cache
    # its prompt's block names, pending on its entry rank until it leaves it (routing)
    pending_blocks: list = field(default_factory=list)
    # a direct hand-off's decode rank may report tokens before the router has taken the
    # hand-off (the prefill rank's report on its way): (rank, report) held until it has
    early_reports: list = field(default_factory=list)
    prompt_hashes: list = field(default_factory=list)  # the current attempt's prompt's

    def note_cached(self, num_cached_tokens: int) -> None:
        if num_cached_tokens > self.cached_tokens:
            self.cached_tokens = min(num_cached_tokens, len(self.request.prompt_token_ids))

    @property
    def attempt_key(self) -> AttemptKey:
        return AttemptKey.of(self.rid, self.attempt)

    @property
    def finished(self) -> bool:
        return self.stage == DONE

    @property
    def tokens_left(self) -> int:
        return self.request.sampling.max_tokens - len(self.tokens)

    def begin_attempt(self) -> AddRequest:
        """A new attempt that computes the whole history so far (prompt + streamed
        tokens) and generates only what is left: the chapter's recompute, across ranks.
        Seeded draws depend on (seed, position), so a moved seeded request continues
        exactly as it would have; ``prior_output_tokens`` tells the rank that the prompt
        ends with the answer so far, which the penalties, min_tokens, the bad words and
        the structured output's grammar go on from."""
        self.attempt += 1
        self.attempt_tokens = 0
        self.progress_at = time.monotonic()
        sampling = dataclasses.replace(self.request.sampling, max_tokens=self.tokens_left,
                                       prior_output_tokens=len(self.tokens))
        return AddRequest(self.attempt_key, self.request.prompt_token_ids + self.tokens,
                          sampling, moved=self.num_moves > 0)

    def accept(self, token_ids: list[int], num_output_tokens: int) -> bool:
        """Count the current attempt's tokens; False when a report went missing."""
        if num_output_tokens != self.attempt_tokens + len(token_ids):
            return False
        self.attempt_tokens = num_output_tokens
        self.progress_at = time.monotonic()
        return True

    def push(self, token_ids: list[int], logprobs: list | None = None) -> None:
        """Stream new tokens (those past max_tokens are dropped, with their logprobs);
        ``logprobs``: one entry per token, from the same report."""
        if self.finished or not token_ids:
            return
        fresh = [int(t) for t in token_ids[: max(0, self.tokens_left)]]
        if not fresh:
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.tokens.extend(fresh)
        self.events.put_nowait(Event(fresh, logprobs=_aligned(logprobs, fresh)))

    def finish(self, reason: str, error: str | None = None,
               token_ids: list[int] | None = None, logprobs: list | None = None) -> bool:
        """Queue the last event; only the first call counts."""
        if self.finished:
            return False
        if reason not in FINISH_REASONS:
            error = error or reason
            reason = "error"
        fresh = [int(t) for t in (token_ids or [])[: max(0, self.tokens_left)]]
        self.tokens.extend(fresh)
        if fresh and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.stage = DONE
        self.finish_reason, self.error = reason, error
        self.events.put_nowait(Event(fresh, reason, error, _aligned(logprobs, fresh)))
        if self.on_finish is not None:
            self.on_finish(self)
        return True


def _aligned(logprobs: list | None, tokens: list[int]) -> list | None:
    """The logprobs of ``tokens`` (the first len(tokens) of a report's), or None when the
    report carried none."""
    if logprobs is None:
        return None
    return list(logprobs[:len(tokens)])


class RequestTracker:
    """Requests by internal id (until their stream is released), labels of the ones in
    flight, and the labels aborted before their Generate arrived.

    A client that sends ``Abort`` right after starting ``Generate`` on another stream
    can be ahead of it; the abort must not be lost. An unknown label is remembered for
    ``early_abort_ttl_s`` (at most ``max_early_aborts`` per tenant, oldest dropped
    first), and only a request that chose that label itself ends at once with "abort"."""

    def __init__(self, max_queue_depth: int, early_abort_ttl_s: float = 60.0,
                 max_early_aborts: int = 4096) -> None:
        self.max_queue_depth = max_queue_depth
        self.early_abort_ttl_s = early_abort_ttl_s
        self.max_early_aborts = max_early_aborts
        # tenant -> {label -> expiry (monotonic), oldest first}: the bound is per tenant,
        # so one tenant's flood of aborts cannot push out another's
        self._early_aborts: dict[str, dict[str, float]] = {}
        self._states: dict[str, RequestState] = {}  # internal id -> state
        # (tenant, label) -> the request in flight for the client under that label
        self._labels: dict[tuple[str, str], RequestState] = {}
        self.num_finished = 0

    def __len__(self) -> int:
        return len(self._states)

    def get(self, rid: str) -> RequestState | None:
        return self._states.get(rid)

    def by_label(self, label: str, tenant: str = "") -> RequestState | None:
        return self._labels.get((tenant, label))

    def by_attempt(self, attempt_key: str) -> RequestState | None:
        """The request whose *current* attempt this is (None: unknown or stale)."""
        key = AttemptKey.parse(attempt_key)
        if key is None:
            return None
        state = self._states.get(key.request)
        if state is None or state.attempt != key.number or state.stage == QUEUED:
            return None  # a moving request's last attempt is already stale
        return state

    def states(self) -> list[RequestState]:
        return list(self._states.values())

    def num_labels(self) -> int:
        return len(self._labels)

    def register(self, request: PreparedRequest, tenant: str = "") -> RequestState:
        """One state per choice (``request.n``), all or none; the first carries the
        label, the others follow it (``siblings``)."""
        label = request.request_id
        if label and (tenant, label) in self._labels:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {label!r} is already in flight")
        if len(self._states) + request.n > self.max_queue_depth:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the router has {len(self._states)} requests in flight "
                f"(max_queue_depth {self.max_queue_depth}"
                + (f", this one adds {request.n} choices" if request.n > 1 else "")
                + "); retry later")
        lead = self._new_state(request, tenant)
        self._labels[(tenant, lead.label)] = lead  # the choices answer to the lead's label
        if request.n > 1:
            lead.siblings.append(lead)
            for i in range(1, request.n):
                choice = dataclasses.replace(request, request_id="",
                                             sampling=request.sampling.for_choice(i))
                sibling = self._new_state(choice, tenant)
                sibling.choice, sibling.siblings, sibling.joins_lead = i, lead.siblings, True
                lead.siblings.append(sibling)
        return lead

    def _new_state(self, request: PreparedRequest, tenant: str) -> RequestState:
        label = request.request_id
        rid = secrets.token_hex(12)
        while rid in self._states:  # 96 random bits: never in practice
            rid = secrets.token_hex(12)
        state = RequestState(request, rid, label or rid, label_chosen=bool(label),
                             tenant=tenant, on_finish=self._ended_for_client)
        self._states[rid] = state
        return state

    def _ended_for_client(self, state: RequestState) -> None:
        """The label is free once every choice of its request has ended."""
        lead = state.siblings[0] if state.siblings else state
        if state.siblings and not all(s.finished for s in state.siblings):
            return
        key = (lead.tenant, lead.label)
        if self._labels.get(key) is lead:
            del self._labels[key]

    def remember_early_abort(self, label: str, tenant: str = "") -> None:
        if not label:
            return
        now = time.monotonic()
        aborts = self._early_aborts.setdefault(tenant, {})
        aborts.pop(label, None)
        aborts[label] = now + self.early_abort_ttl_s
        self._drop_expired(now)
        while len(aborts) > self.max_early_aborts:
            del aborts[next(iter(aborts))]

    def take_early_abort(self, label: str, tenant: str = "") -> bool:
        """Was ``label`` aborted by ``tenant`` before it arrived (and not long ago)?
        Forgets it. Ask only for a label the client chose (a generated id never matches)."""
        self._drop_expired(time.monotonic())
        return self._early_aborts.get(tenant, {}).pop(label, None) is not None

    def _drop_expired(self, now: float) -> None:
        for tenant, aborts in list(self._early_aborts.items()):
            while aborts and aborts[next(iter(aborts))] <= now:
                del aborts[next(iter(aborts))]
            if not aborts:
                del self._early_aborts[tenant]

    def release(self, rid: str) -> None:
        state = self._states.pop(rid, None)
        if state is not None:
            self._ended_for_client(state)
            self.num_finished += 1
