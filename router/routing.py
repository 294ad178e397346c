"""The router's choice of a rank, as pure functions over rank views (no Ray, no asyncio).

``Pool.choose_prefill`` / ``Pool.choose_decode`` (router/pools.py) call these on their
``RankHandle``s; the simulator (simulator/routing.py) calls the same functions on its
simulated ranks, so both pick by one rule. A rank here is anything with the attributes
the keys read: ``outstanding_tokens``, ``inflight`` (sized), ``assigned``, ``uid``,
``free_blocks``, ``pending_imports`` and ``cached_prefix_blocks(hashes)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.scheduler.prefix_hash import cacheable_blocks, chain_hashes

# Room a decode rank is charged per import on its way (its blocks are not taken yet).
BLOCKS_PER_PENDING_IMPORT = 8


@dataclass
class PromptBlocks:
    """A prompt as cache-aware routing sees it: its length and its cacheable blocks'
    names (``prefix_hash.chain_hashes``)."""

    num_tokens: int
    block_size: int
    hashes: list[bytes]
    cached_tokens: int = 0  # the chosen rank's cached prefix, in tokens

    @classmethod
    def of(cls, token_ids: list[int], block_size: int) -> PromptBlocks:
        n = cacheable_blocks(len(token_ids), block_size)
        return cls(len(token_ids), block_size, chain_hashes(token_ids, block_size, n))


def cached_prefix_blocks(cached: set[bytes], pending: dict[bytes, int],
                         hashes: Iterable[bytes]) -> int:
    """How many of ``hashes`` (a prompt's block names, in order) a rank holds from the
    first on: cached there, or pending (sent there, being computed)."""
    n = 0
    for h in hashes:
        if h not in cached and h not in pending:
            break
        n += 1
    return n


def add_pending(pending: dict[bytes, int], hashes: Iterable[bytes]) -> None:
    """A prompt sent to a rank: its blocks count as held there until it is computed."""
    for h in hashes:
        pending[h] = pending.get(h, 0) + 1


def drop_pending(pending: dict[bytes, int], hashes: Iterable[bytes]) -> None:
    for h in hashes:
        left = pending.get(h, 0) - 1
        if left > 0:
            pending[h] = left
        else:
            pending.pop(h, None)


def apply_cache_events(cached: set[bytes], events: Iterable[tuple[bool, bytes]],
                       total_blocks: int) -> None:
    """A rank's step report of blocks named (stored) or evicted, applied to its names."""
    for stored, block_hash in events:
        if stored:
            cached.add(block_hash)
        else:
            cached.discard(block_hash)
    if total_blocks and len(cached) > 2 * total_blocks:  # more names than blocks: a report went missing
        cached.clear()


def least_loaded_key(rank) -> tuple:
    """The queue alone: prompt tokens sent and not yet prefilled; ties: requests in
    flight, then round-robin (requests ever sent), then the rank's id."""
    return (rank.outstanding_tokens, len(rank.inflight), rank.assigned, rank.uid)


def prefill_key(rank, prompt: PromptBlocks | None, routing: str, weight: float) -> tuple:
    """Smaller is better. ``cache_aware``: the queue + ``weight`` x the prompt's tokens
    past the prefix the rank holds; otherwise ``least_loaded_key``."""
    if prompt is None or routing != "cache_aware":
        return least_loaded_key(rank)
    matched = rank.cached_prefix_blocks(prompt.hashes)
    return (rank.outstanding_tokens + weight * (prompt.num_tokens - prompt.block_size * matched),
            len(rank.inflight), rank.assigned, rank.uid)


def choose_prefill(ranks: Sequence, prompt: PromptBlocks | None, routing: str,
                   weight: float):
    """The rank with the smallest ``prefill_key`` (None if there is none); counts the
    choice (``assigned``) and sets ``prompt.cached_tokens`` to the chosen rank's match."""
    if not ranks:
        return None
    rank = min(ranks, key=lambda r: prefill_key(r, prompt, routing, weight))
    if prompt is not None:
        prompt.cached_tokens = (prompt.block_size * rank.cached_prefix_blocks(prompt.hashes)
                                if routing == "cache_aware" else 0)
    rank.assigned += 1
    return rank


def decode_room(rank) -> int:
    """Free blocks once the imports on their way are in (before any cached prefix)."""
    return rank.free_blocks - BLOCKS_PER_PENDING_IMPORT * rank.pending_imports


def decode_key(rank, prompt_hashes: Sequence[bytes] = ()) -> tuple:
    """Larger is better: room once the payload is in (its prefix blocks the rank's cache
    holds are neither sent nor allocated); ties: fewer in flight, fewer ever sent, uid."""
    return (decode_room(rank) + (rank.cached_prefix_blocks(prompt_hashes) if prompt_hashes else 0),
            -len(rank.inflight), -rank.assigned, -rank.uid)


def choose_decode(ranks: Sequence, prompt_hashes: Sequence[bytes] = ()):
    """The rank with the largest ``decode_key`` (None if there is none); counts the choice."""
    if not ranks:
        return None
    rank = max(ranks, key=lambda r: decode_key(r, prompt_hashes))
    rank.assigned += 1
    return rank
