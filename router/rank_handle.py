"""The router's handle on one engine rank: its Ray actor, its state in the pool, what the
router placed on it, and what its reports said (stats, cached blocks)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pdserve.rank.messages import EngineStats, RankInfo
from pdserve.router import routing

STARTING, READY, DRAINING, DEAD = "starting", "ready", "draining", "dead"


@dataclass
class RankHandle:
    pool: str
    actor: Any
    uid: int
    state: str = STARTING
    rank: int = -1
    info: RankInfo | None = None
    stats: EngineStats = field(default_factory=EngineStats)  # from its latest poll
    inflight: set[str] = field(default_factory=set)  # attempt keys on this rank
    exports: set[str] = field(default_factory=set)   # its payloads not yet delivered
    outstanding_tokens: int = 0   # prompt tokens sent here and not yet prefilled
    pending_imports: int = 0      # payloads on their way here
    assigned: int = 0             # requests ever sent here (breaks ties round-robin)
    poll_task: asyncio.Task | None = None
    error: str | None = None
    ready_at: float | None = None  # time.monotonic() it first became READY (warm-up)
    num_loop_failures: int = 0    # engine-loop failures in a row (one per generation)
    failed_generation: int = -1   # the group generation of the last one
    # Names of the full blocks its prefix cache holds, from its step reports
    # (prefix_hash.py): what cache-aware routing matches prompts against. And the
    # blocks of prompts sent here and not yet computed (name -> how many): the next
    # request with the same prefix should follow them rather than compute it elsewhere.
    cached_blocks: set[bytes] = field(default_factory=set)
    pending_blocks: dict[bytes, int] = field(default_factory=dict)

    def add_pending(self, hashes: list[bytes]) -> None:
        routing.add_pending(self.pending_blocks, hashes)

    def drop_pending(self, hashes: list[bytes]) -> None:
        routing.drop_pending(self.pending_blocks, hashes)

    def apply_cache_events(self, events: list[tuple[bool, bytes]]) -> None:
        routing.apply_cache_events(self.cached_blocks, events,
                                   self.info.num_total_blocks if self.info else 0)

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many of ``hashes`` (a prompt's block names, in order) this rank holds
        from the first on."""
        return routing.cached_prefix_blocks(self.cached_blocks, self.pending_blocks, hashes)

    @property
    def free_blocks(self) -> int:
        if self.stats.num_total_blocks:
            return int(self.stats.num_free_blocks)
        return self.info.num_total_blocks if self.info else 0

    @property
    def name(self) -> str:
        return f"{self.pool} rank {self.rank} (#{self.uid})"
