"""The stand-in ranks of `bench kv-transfer`: either end of a KV hand-off, with a real
KV cache of the built-in tiny model's shape, and everything a transport calls on an
engine rank (`PayloadRank`, run as a Ray actor by `kv_transfer.py`). Only the model and
the scheduler are left out.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer import EndpointSizing, make_endpoint
from pdserve.rank.messages import HandoffTicket, ImportResult

# The stand-in ranks' KV cache: the built-in tiny model's shape (4 layers, 2 KV heads of
# 64 dims, fp32, 16-token blocks): 64 KiB a block, 4 KiB a token.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 16
BLOCK_BYTES = 2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4


def num_blocks_for(nbytes: int) -> int:
    return max(1, nbytes // BLOCK_BYTES)


def kv_cache(num_blocks: int, seed: int | None, copy_threads: int = 1):
    """A KV cache of ``num_blocks`` usable blocks (random contents with ``seed``),
    copying blocks in and out with ``copy_threads`` threads."""
    # lazy: torch and the KV cache, only when a rank is built (`pdserve --help` imports this module)
    import torch

    from pdserve.kernels.kv_cache import KVCache

    cache = KVCache(LAYERS, KV_HEADS, HEAD_DIM, num_blocks + 1, BLOCK_SIZE,
                    copy_threads=copy_threads)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in (*cache.k_blocks, *cache.v_blocks):
            layer.copy_(torch.randn(layer.shape, generator=g))
    return cache


def block_checksum(cache, block_ids: list[int]) -> float:
    """What arrived, cheaply: the sum of K and V of the first and last of ``block_ids``."""
    ends = [block_ids[0], block_ids[-1]]
    return float(sum(layer[ends].double().sum() for layer in (*cache.k_blocks, *cache.v_blocks)))


class PayloadRank:
    """Stands in for an engine rank on either end of a hand-off (a Ray actor), with a
    real KV cache: the source gathers a prompt's blocks into the buffer its transport
    lends (``write_payload``, as the engine does), the destination parses the payload
    and scatters it into its own blocks (``KVCache.import_sequence``), as a decode rank
    does; only the model and the scheduler are left out."""

    def __init__(self, kv_transport: str, secret: Any = None, staging_bytes: int = 0,
                 copy_threads: int = 1) -> None:
        self.copy_threads = copy_threads
        self.endpoint = make_endpoint(kv_transport, self, "127.0.0.1", secret=secret,
                                      sizing=EndpointSizing(staging_bytes=staging_bytes))
        self._cache: Any = None
        self._tables: dict[str, list[int]] = {}
        self._table_cache: dict[tuple[int, int], list[int]] = {}
        self.imported = 0
        # how payloads reached this rank: mapped from the sender's segment (one node), or
        # as an object Ray resolved (another node, or one that could not be staged)
        self.import_paths = {"shared memory": 0, "object": 0}
        # asked by the router's transport through a local socket on one node, as a
        # decode rank is (kv_transfer/ray/wake_channel.py), else by a Ray call
        self.wake_address = self.endpoint.listen_for_wakes()

    def info(self) -> Any:
        node_id = ""
        try:
            # lazy: ray is heavy; only a rank inside a Ray worker has a node
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        except Exception:
            pass
        return _Info(os.getpid(), self.endpoint.address, node_id, self.wake_address)

    def _cache_for(self, num_blocks: int, seed: int | None):
        if self._cache is None or self._cache.num_blocks - 1 < num_blocks:
            self._cache = kv_cache(num_blocks, seed, self.copy_threads)
        return self._cache

    def _table(self, num_blocks: int, seed: int) -> list[int]:
        """A block table of ``num_blocks`` shuffled ids (the same for the same seed).
        Made once per size: it stands in for the scheduler's allocation, which is left
        out, and shuffling 4096 ids costs ~2 ms, inside the destination's timed import."""
        key = (num_blocks, seed)
        if key not in self._table_cache:
            ids = list(range(1, num_blocks + 1))
            random.Random(seed).shuffle(ids)  # a prompt's blocks lie anywhere in the pool
            self._table_cache[key] = ids
        return self._table_cache[key]

    def export(self, attempt: str, nbytes: int, kv_transport: str) -> tuple[Any, float, float]:
        """(ticket, seconds the export took, checksum of what it sent): what the engine's
        hand-off and EngineRank._export do."""
        # lazy: engine.kv.payload imports torch
        from pdserve.engine.kv.payload import KVPayload, write_payload

        n = num_blocks_for(nbytes)
        cache = self._cache_for(n, seed=0)
        table = self._table(n, seed=len(attempt))
        tokens = n * BLOCK_SIZE
        payload = KVPayload(attempt, "bench", "float32", BLOCK_SIZE, LAYERS,
                            token_ids=[7] * tokens + [8], num_prompt_tokens=tokens, sampling={})
        start = time.perf_counter()
        buffer = write_payload(payload, cache, table, 0, tokens, self.endpoint.payload_buffer,
                               attempt)
        locator = self.endpoint.export(attempt, buffer)
        took = time.perf_counter() - start
        return (HandoffTicket(attempt, 0, tokens, len(buffer), locator), took,
                block_checksum(cache, table))

    # the engine-rank methods the transports call
    def import_prefilled(self, payload, borrowed: bool = False, skip_blocks: int = 0) -> Any:
        # lazy: engine.kv.payload imports torch
        from pdserve.engine.kv.payload import KVPayload, KVPayloadError

        try:
            kv = KVPayload.from_bytes(payload)
        except KVPayloadError as exc:
            return ImportResult(False, kind="payload", error=str(exc))
        n = kv.tensors["k_blocks"].shape[1]
        cache = self._cache_for(n, seed=None)
        table = self._table(n, seed=7)
        cache.import_sequence(table, 0, kv.tensors)
        self._tables[kv.attempt] = table
        self.imported += 1
        self.import_paths["shared memory" if borrowed else "object"] += 1
        return ImportResult(True, attempt=kv.attempt, nbytes=len(payload))

    def paths(self) -> dict[str, int]:
        return dict(self.import_paths)

    def kv_call(self, call: Any, *data: Any) -> Any:
        """The transport's own calls, answered by the endpoint (as on an engine rank)."""
        return self.endpoint.handle(call, *data)

    def abort(self, attempt: str) -> bool:
        """An import whose bytes the sender reused while they were read: forgotten."""
        return self._tables.pop(attempt, None) is not None

    def checksum(self, attempt: str) -> float:
        return block_checksum(self._cache, self._tables.pop(attempt))

    def release_kv(self, attempt: str) -> None:
        self.endpoint.release(attempt)

    def shutdown(self) -> None:
        self.endpoint.close()


@dataclass
class _Info:
    pid: int
    kv_address: str | None
    node_id: str = ""
    wake_address: str = ""
