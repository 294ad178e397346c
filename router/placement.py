"""Where each request's current attempt runs: the one place that changes it.

A request's placement is its ``prefill_rank`` / ``decode_rank`` (``RequestState``) and,
on each rank, the attempt in ``inflight`` with the prompt tokens it still computes
(``outstanding_tokens``) and the prompt blocks it will name (``pending``). ``begin_on``
puts an attempt on a rank, ``decoding_on`` puts a handed-off one on its decode rank,
``leave`` takes it off one; nothing else in the router writes those fields.
"""

from __future__ import annotations

import asyncio
import time

from pdserve.rank.messages import AddRequest, AttemptKey
from pdserve.router.rank_handle import RankHandle
from pdserve.router.requests import DECODE, PREFILL, RequestState


def begin_on(rank: RankHandle, state: RequestState, disaggregated: bool) -> AddRequest:
    """The request's next attempt, placed on ``rank`` (sent by the caller)."""
    add = state.begin_attempt()
    state.stage = PREFILL if disaggregated else DECODE
    state.prefill_rank = rank if disaggregated else None
    state.decode_rank = None if disaggregated else rank
    state.outstanding = 0
    rank.inflight.add(add.attempt)
    if state.dispatched_at is None:
        state.dispatched_at = time.monotonic()
        state.timings["router_queue_s"] = state.dispatched_at - state.created
    return add


def computes_on(rank: RankHandle, state: RequestState, tokens: int,
                hashes: list[bytes]) -> None:
    """The attempt just begun on ``rank`` computes ``tokens`` prompt tokens there, and
    names the prompt blocks ``hashes`` once computed."""
    state.outstanding = tokens
    rank.outstanding_tokens += tokens
    state.pending_blocks = hashes
    rank.add_pending(hashes)


def decoding_on(dst: RankHandle, state: RequestState, attempt: AttemptKey) -> None:
    """A hand-off's choice goes to decode rank ``dst`` (its import is on the way)."""
    state.decode_rank = dst
    dst.inflight.add(attempt)


def leave(rank: RankHandle | None, state: RequestState) -> None:
    """The request's current attempt is off ``rank`` (done, moved or handed off)."""
    if rank is None:
        return
    key = state.attempt_key
    if key in rank.inflight:
        rank.inflight.discard(key)
        if rank.pool in ("prefill", "normal"):
            rank.outstanding_tokens = max(0, rank.outstanding_tokens - state.outstanding)
    if state.pending_blocks and rank.pool in ("prefill", "normal"):
        # computed (its names arrive as cache events) or never will be here
        rank.drop_pending(state.pending_blocks)
        state.pending_blocks = []


def ranks_of(state: RequestState) -> list[RankHandle]:
    """The distinct ranks a request's current attempt is on."""
    ranks = [r for r in (state.prefill_rank, state.decode_rank) if r is not None]
    return ranks[:1] if len(ranks) == 2 and ranks[0] is ranks[1] else ranks


async def abort_on(rank: RankHandle, attempt: AttemptKey, timeout_s: float) -> None:
    """Stop ``attempt`` on ``rank`` (within ``timeout_s``; a dead rank holds nothing, a
    hung one is its poller's business)."""
    try:
        await asyncio.wait_for(rank.actor.abort.remote(attempt), timeout_s)
    except Exception:
        pass
