"""The one interface every KV transport implements (router side).

The worker side of a transport is `EngineRank._export`: it turns a HandOff into a
`ticket` (picklable) that travels in the prefill rank's poll reply. The router then
calls `deliver(ticket, src, dst)` to import the payload on the decode rank, or
`discard(ticket, src)` when the request was aborted on the way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class DeliveryResult:
    ok: bool
    request_id: str = ""
    kind: str = ""  # on failure: "payload" | "capacity" | "transport"
    error: str = ""
    nbytes: int = 0


class KVTransport(ABC):
    name: str = ""

    def __init__(self) -> None:
        self.bytes_moved = 0
        self.num_deliveries = 0

    @abstractmethod
    async def deliver(self, ticket: Any, src: Any, dst: Any) -> DeliveryResult:
        """Import the payload behind `ticket` (exported by rank `src`) on rank `dst`."""

    @abstractmethod
    async def discard(self, ticket: Any, src: Any) -> None:
        """Free the payload behind `ticket` without importing it anywhere."""

    async def close(self) -> None:
        return None
