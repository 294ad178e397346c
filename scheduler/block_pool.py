"""Reference-counted ids with a FIFO free list: KV blocks and state slots alike (S1-S3)."""

from __future__ import annotations

import enum
from collections import OrderedDict, deque


class AllocStatus(enum.Enum):
    OK = 0
    LATER = 1  # fits once others free enough
    NEVER = 2  # can never fit, however much is freed


class BlockPool:
    """Ids 1..num_blocks-1 are handed out; id 0 is reserved so padding rows have a
    harmless target. Freed ids go to the back, so recently freed ids are reused last."""

    __slots__ = ("num_blocks", "free_queue", "_refs")
    num_evictions = 0  # no names, no evictions (a CachingBlockPool counts its own)

    @property
    def num_cached(self) -> int:
        return 0  # blocks kept for their names (CachingBlockPool)

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (id 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        # Read-only for callers (hot loops test it for emptiness); mutate through methods.
        self.free_queue: deque[int] = deque(range(1, num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free_queue)

    @property
    def free_ids(self) -> list[int]:
        return list(self.free_queue)

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    def can_allocate(self, n: int) -> AllocStatus:
        if n >= self.num_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if len(self.free_queue) >= n else AllocStatus.LATER

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"cannot allocate {n} ids, {len(self.free_queue)} free")
        free, refs = self.free_queue, self._refs
        ids = [free.popleft() for _ in range(n)]
        for i in ids:
            refs[i] = 1
        return ids

    def allocate_one(self) -> int:
        i = self.free_queue.popleft()
        self._refs[i] = 1
        return i

    def pin(self, ids: list[int]) -> None:
        refs = self._refs
        for i in ids:
            if refs[i] <= 0:
                raise RuntimeError(f"cannot pin free id {i}")
            refs[i] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each id, last one first (S1: with prefix caching, a
        sequence's tail blocks are evicted before its head, which more requests share)."""
        refs, back = self._refs, self._to_free_list
        for i in reversed(ids):
            if refs[i] <= 0:
                raise RuntimeError(f"double free of id {i}")
            refs[i] -= 1
            if refs[i] == 0:
                back(i)

    def _to_free_list(self, i: int) -> None:
        self.free_queue.append(i)

    def free_one(self, i: int) -> None:
        self.free((i,))

    def leaks(self) -> list[str]:
        """Why the pool is not drained, if it is not (empty when every id is free)."""
        problems = []
        held = [i for i in range(1, self.num_blocks) if self._refs[i] != 0]
        if held:
            problems.append(f"ids still referenced {{id: refs}}: {{{', '.join(f'{i}: {self._refs[i]}' for i in held[:32])}}}")
        if len(self.free_queue) != self.num_blocks - 1 or len(set(self.free_queue)) != len(self.free_queue):
            problems.append(f"free list has {len(self.free_queue)} ids, expected {self.num_blocks - 1}")
        if self._refs[0] != 0 or 0 in self.free_queue:
            problems.append("reserved id 0 was handed out")
        return problems


class CachingBlockPool(BlockPool):
    """A BlockPool whose full blocks can carry a content hash (prefix caching).

    A hashed block whose last reference goes stays in the free list and keeps its hash:
    it is *evictable*, free for any allocation (oldest freed first, as before) and
    reusable by a request whose prefix hashes to it until then; allocating it evicts
    the hash. So "free" (S2, S3, S5, S35) counts evictable blocks: they hold nothing
    anyone references. ``events`` collects (stored?, hash) in order as hashes come and
    go, for the rank's step reports (``drain_events``)."""

    __slots__ = ("_hash_of", "_block_of", "events", "num_evictions")

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        # insertion order = freed order; O(1) removal of a cached block a request takes
        self.free_queue = OrderedDict.fromkeys(range(1, num_blocks))  # type: ignore[assignment]
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.events: list[tuple[bool, bytes]] = []
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def allocate(self, n: int) -> list[int]:
        free, refs = self.free_queue, self._refs
        if n > len(free):
            raise RuntimeError(f"cannot allocate {n} ids, {len(free)} free")
        ids = []
        for _ in range(n):
            i = free.popitem(last=False)[0]  # type: ignore[call-arg]
            if i in self._hash_of:
                self._evict(i)
            refs[i] = 1
            ids.append(i)
        return ids

    def allocate_one(self) -> int:
        return self.allocate(1)[0]

    def _to_free_list(self, i: int) -> None:
        self.free_queue[i] = None  # type: ignore[index]  # keeps its name: evictable

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached run of ``hashes`` from the first."""
        ids = []
        for h in hashes:
            i = self._block_of.get(h)
            if i is None:
                break
            ids.append(i)
        return ids

    def num_free_among(self, ids: list[int]) -> int:
        return sum(self._refs[i] == 0 for i in ids)

    def take(self, ids: list[int]) -> None:
        """Reference cached blocks (out of the free list if nothing else held them)."""
        refs, free = self._refs, self.free_queue
        for i in ids:
            if refs[i] == 0:
                del free[i]  # type: ignore[attr-defined]
            refs[i] += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """A full block's KV is written: name it by its hash. The first block with a
        given content keeps the name (a duplicate computed alongside stays unnamed)."""
        if block_hash in self._block_of or block_id in self._hash_of:
            return
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        self.events.append((True, block_hash))

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id)
        del self._block_of[block_hash]
        self.events.append((False, block_hash))
        self.num_evictions += 1

    def drain_events(self) -> list[tuple[bool, bytes]]:
        events, self.events = self.events, []
        return events
