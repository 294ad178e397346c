"""KV through Ray's object store: the prefill rank `ray.put`s the payload; the decode
rank receives it as a resolved argument (zero-copy on one node, Ray's transfer across
nodes). The router only ever holds the reference, never the bytes."""

from __future__ import annotations

from typing import Any

from pdserve.router.transports.base import DeliveryResult, KVTransport


class RayObjectStoreTransport(KVTransport):
    name = "ray"

    async def deliver(self, ticket: Any, src: Any, dst: Any) -> DeliveryResult:
        try:
            result = await dst.actor.import_prefilled.remote(ticket)
        except Exception as exc:  # the source died (object lost) or the destination did
            return DeliveryResult(False, kind="transport", error=f"{type(exc).__name__}: {exc}")
        if not result["ok"]:
            return DeliveryResult(False, kind=result["kind"], error=result["error"])
        self.num_deliveries += 1
        return DeliveryResult(True, request_id=result["request_id"])

    async def discard(self, ticket: Any, src: Any) -> None:
        # Dropping the last reference frees the object; nothing to tell the worker.
        return None
