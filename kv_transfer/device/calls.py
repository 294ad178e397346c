"""The ``device`` backend's calls from the router to a rank's endpoint (sent as
``rank.kv_call.remote(call)``, answered by ``DeviceEndpoint`` by type)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kv_transfer.device.cuda_ipc import IpcHandle


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


@dataclass(frozen=True)
class SharePayload:
    """Source: share ``attempt``'s payload (its first ``skip_blocks`` blocks cut off
    first) by CUDA IPC; answers its IpcHandle, or an ImportResult saying why not
    (UNREACHABLE: the driver refused, use the pair group)."""

    attempt: str
    skip_blocks: int


@dataclass(frozen=True)
class MapPayload:
    """Destination: map a shared payload, import it and unmap it; answers the import's
    ImportResult (UNREACHABLE: it could not be mapped here). ``nbytes``: the ticket's
    size, which bounds the handle's."""

    handle: IpcHandle
    nbytes: int
    skip_blocks: int
