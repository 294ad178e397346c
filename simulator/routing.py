"""The router's routing policy over simulated ranks, at the scale of thousands of them.

The choice itself is the router's (``router/routing.py``: ``choose_prefill``,
``choose_decode``, the same functions ``router/pools.py`` calls). Scanning every rank
for each of a million requests would dominate a large run, so the functions are
called on a small candidate list that provably holds the router's pick:

- the best rank by the prompt-free order (``least_loaded_key`` for prefill,
  ``decode_key`` without hashes for decode), kept in a heap with lazy invalidation
  (a rank whose key changes is pushed again; stale entries are skipped);
- every rank that may hold the prompt's first block (sent a prompt with that first
  block, or imported one): only those can score better than their prompt-free key.

A rank without the prompt's first block scores its prompt-free key (plus a constant),
so the heap's best of those is the best of them; the candidates are then ranked by
the router's own key, ties included.
"""

from __future__ import annotations

import heapq

from pdserve.router import routing
from pdserve.router.routing import PromptBlocks, decode_room, least_loaded_key


class IndexedChooser:
    def __init__(self, ranks: list, order) -> None:
        self._order = order  # rank -> tuple, smaller is better
        self._ranks = {r.uid: r for r in ranks}
        self._version = {r.uid: 0 for r in ranks}
        self._listed: dict[int, tuple] = {}  # uid -> the key of its valid heap entry
        self._heap: list[tuple[tuple, int, int]] = []
        self._holders: dict[bytes, set[int]] = {}  # first block name -> uids that may hold it
        for r in ranks:
            self.touch(r)

    def touch(self, rank) -> None:
        """``rank``'s key may have changed. A key no better than its heap entry's
        needs no new entry (``best`` corrects an entry that is too good when it comes
        up): decode ranks touch after every step, and most steps only take blocks."""
        uid = rank.uid
        key = self._order(rank)
        listed = self._listed.get(uid)
        if listed is not None and key >= listed:
            return
        v = self._version[uid] = self._version[uid] + 1
        heapq.heappush(self._heap, (key, v, uid))
        self._listed[uid] = key
        if len(self._heap) > 8 * len(self._ranks) + 64:  # drop what is stale
            self._heap = [(self._order(r), self._version[u], u) for u, r in self._ranks.items()]
            heapq.heapify(self._heap)
            self._listed = {u: key for key, _, u in self._heap}

    def best(self):
        """The rank with the smallest key. An entry whose rank got worse since it was
        pushed is pushed again with its key of now, so only improvements need a
        ``touch`` to be seen."""
        heap, version, order = self._heap, self._version, self._order
        while True:
            key, v, uid = heap[0]
            if v != version[uid]:
                heapq.heappop(heap)
                continue
            rank = self._ranks[uid]
            now = order(rank)
            if now == key:
                return rank
            heapq.heapreplace(heap, (now, v, uid))
            self._listed[uid] = now

    def note_holder(self, first_block: bytes, rank) -> None:
        self._holders.setdefault(first_block, set()).add(rank.uid)

    def candidates(self, hashes: list[bytes]) -> list:
        best = self.best()
        if not hashes:
            return [best]
        uids = self._holders.get(hashes[0])
        if not uids:
            return [best]
        out = [best]
        for uid in sorted(uids):
            r = self._ranks[uid]
            if r.cached_prefix_blocks(hashes[:1]):
                if r is not best:
                    out.append(r)
            else:
                uids.discard(uid)  # evicted (or never computed): no longer a holder
        if not uids:
            del self._holders[hashes[0]]
        return out


class PrefillRouter:
    """``choose_prefill`` of the router over a pool's ranks."""

    def __init__(self, ranks: list, routing_name: str, weight: float) -> None:
        self.routing = routing_name
        self.weight = weight
        self.index = IndexedChooser(ranks, least_loaded_key)

    def choose(self, prompt: PromptBlocks):
        hashes = prompt.hashes if self.routing == "cache_aware" else []
        rank = routing.choose_prefill(self.index.candidates(hashes), prompt, self.routing,
                                      self.weight)
        if hashes:
            self.index.note_holder(hashes[0], rank)
        self.index.touch(rank)
        return rank


def decode_order(rank) -> tuple:
    """``decode_key(rank)`` negated, smaller is better (heap order), without a prompt.
    Spelled out, not negated element by element: it is computed after every decode
    step of every rank (``tests/simulator/test_routing.py`` checks the two agree)."""
    return (-decode_room(rank), len(rank.inflight), rank.assigned, rank.uid)


class DecodeRouter:
    """``choose_decode`` of the router over the decode pool's ranks."""

    def __init__(self, ranks: list) -> None:
        self.index = IndexedChooser(ranks, decode_order)

    def choose(self, prompt_hashes: list[bytes]):
        rank = routing.choose_decode(self.index.candidates(prompt_hashes), prompt_hashes)
        if prompt_hashes:
            self.index.note_holder(prompt_hashes[0], rank)
        self.index.touch(rank)
        return rank
