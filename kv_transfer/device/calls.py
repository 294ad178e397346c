"""The ``device`` backend's calls from the router to a rank's endpoint (sent as
``rank.kv_call.remote(call)``, answered by ``DeviceEndpoint`` by type)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpenPair:
    """Source: host pair ``pair``'s store on this node; answers its tcp:// address."""

    pair: str
    timeout_s: float


@dataclass(frozen=True)
class JoinPair:
    """Join pair ``pair``'s group as ``rank`` (0: source, 1: destination); answers "" once
    formed, else what failed (the nonce never shown)."""

    pair: str
    address: str
    rank: int
    nonce: str
    backend: str
    timeout_s: float

    def __repr__(self) -> str:  # Ray may show a failed call's arguments
        return f"JoinPair({self.pair!r}, rank={self.rank}, backend={self.backend!r})"


@dataclass(frozen=True)
class SendPayload:
    """Source: send ``attempt``'s payload over ``pair`` (its first ``skip_blocks`` blocks
    cut off first); answers an ImportResult whose ``nbytes`` is what crossed."""

    pair: str
    attempt: str
    skip_blocks: int
    timeout_s: float


@dataclass(frozen=True)
class ReceivePayload:
    """Destination: receive one payload over ``pair`` and import it; answers the import's
    ImportResult (a failed receive: kind TRANSPORT)."""

    pair: str
    nbytes: int
    skip_blocks: int
    timeout_s: float


@dataclass(frozen=True)
class DropPair:
    """Forget pair ``pair``'s group (closed once its transfers ended)."""

    pair: str
