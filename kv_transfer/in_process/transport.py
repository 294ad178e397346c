"""KV handed between engine ranks that live in one process (tests, offline use).

1. Export: the payload stays in the source's ``RankEndpoint``; the locator is the
   attempt key.
2. Deliver: the router side calls ``dst.import_prefilled(bytes)`` directly (``src`` and
   ``dst`` are objects with an ``endpoint`` and an ``import_prefilled`` method).
3. Release / discard: drop the bytes from the source's endpoint (through the base's one
   release path, like every backend).
The payload still goes through its bytes form, so what is tested is what crosses a
process boundary on the other transports.
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
    payload_without_prefix,
)


class InProcessTransport(KVTransport):
    name = "in_process"

    async def deliver(self, ticket: Any, src: Any, dst: Any,
                      skip_blocks: int = 0) -> DeliveryResult:
        data = src.endpoint.get(ticket.locator)
        if data is None:
            return DeliveryResult(False, kind=TRANSPORT,
                                  error=f"no KV payload for {ticket.key!r}")
        if skip_blocks:
            data = payload_without_prefix(data, skip_blocks)
        result = dst.import_prefilled(data)
        if not result.ok:
            return DeliveryResult(False, kind=result.kind if result.kind in (CAPACITY, CACHE_MISS)
                                  else PAYLOAD, error=result.error)
        self._delivered(len(data))
        return DeliveryResult(True, attempt=result.attempt, nbytes=len(data))

    def held_key(self, ticket: Any) -> str | None:
        return ticket.locator

    async def _free_on_source(self, src: Any, keys: list[str], many: bool) -> None:
        for key in keys:
            src.endpoint.release(key)
