"""KV through Ray's object store, all sides.

1. Export (prefill rank): ``ray.put`` of the payload as a uint8 array; the locator is
   the ObjectRef, owned by the prefill rank's process.
2. Deliver (router): the decode rank gets the ref as an argument of
   ``import_prefilled``; Ray resolves it (a read-only view of the shared object store on
   one node: no copy; Ray's node-to-node transfer across nodes). The router only ever
   holds the reference, never the bytes. ``skip_blocks``: the source cuts the prefix
   the receiver's cache holds into a new object first (``EngineRank.kv_without_prefix``).

Copies of the KV bytes on one node: the engine's export gathers the blocks (1) and
frames them as bytes (2: per tensor, then joined); ``ray.put`` copies them into the
object store (1); delivery copies nothing (the receiver maps the object; bytes would be
copied out, which is why the payload travels as an array); the import copies each
tensor out of the mapped buffer (1) and scatters it into the cache's blocks (1).
3. Release / discard: the router drops its reference once the import is confirmed (or
   the request ended), which frees the object. Until then the ref keeps it alive, so a
   failed or timed-out delivery can be retried; if the prefill rank died, the object is
   lost with it and the request is re-prefilled elsewhere.
"""

from __future__ import annotations

from typing import Any

from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD,
    TRANSPORT,
    DeliveryResult,
    KVTransport,
    RankEndpoint,
)


class RayEndpoint(RankEndpoint):
    def export(self, attempt: str, payload: bytes) -> Any:
        import numpy as np
        import ray

        # As a uint8 array, not bytes: Ray hands an array to the receiver as a read-only
        # view of the shared object store (zero-copy on one node); bytes it copies out.
        return ray.put(np.frombuffer(payload, dtype=np.uint8))

    def release(self, attempt: str) -> None:
        return None  # the object goes when the router's last reference does


class RayObjectStoreTransport(KVTransport):
    name = "ray"

    async def deliver(self, ticket: Any, src: Any, dst: Any,
                      skip_blocks: int = 0) -> DeliveryResult:
        locator, nbytes = ticket.locator, ticket.nbytes
        try:
            if skip_blocks:  # cut on the source, into a new object: the prefix stays there
                locator = src.actor.kv_without_prefix.remote(ticket.locator, skip_blocks)
            result = await dst.actor.import_prefilled.remote(locator)
        except Exception as exc:  # the source died (object lost) or the destination did
            return DeliveryResult(False, kind=TRANSPORT, error=f"{type(exc).__name__}: {exc}")
        if not result.ok:
            return DeliveryResult(False, kind=result.kind if result.kind in (
                PAYLOAD, CAPACITY, CACHE_MISS) else PAYLOAD, error=result.error)
        if skip_blocks:
            nbytes = result.nbytes or nbytes
        self._delivered(nbytes)
        return DeliveryResult(True, attempt=result.attempt, nbytes=nbytes)

    async def discard(self, ticket: Any, src: Any) -> None:
        # Dropping the last reference frees the object; nothing to tell the worker.
        return None
