"""KV through Ray's object store, all sides.

1. Export (prefill rank): ``ray.put(payload)``; the locator is the ObjectRef, owned by
   the prefill rank's process.
2. Deliver (router): the decode rank gets the ref as an argument of
   ``import_prefilled``; Ray resolves it (zero-copy read on one node, Ray's node-to-node
   transfer across nodes). The router only ever holds the reference, never the bytes.
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
        import ray

        return ray.put(payload)

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
