"""KV as bytes through the router over gRPC, all sides.

1. Export (prefill rank): the payload stays in the rank's ``GrpcEndpoint``, which serves
   ``Fetch`` on its own port; the locator is ``(address, attempt)``.
2. Deliver (router): pull ~1 MiB chunks from the prefill rank's ``Fetch`` and push them,
   as they arrive, to the decode rank's ``Push``, which imports them (receive side:
   ``KVTransferServicer.Push`` -> ``EngineRank.import_prefilled``).
3. Release / discard: ``Fetch`` does not consume the payload; the router releases it
   (``release_kv`` on the prefill rank) only after the decode rank confirmed the
   import, so a relay that fails half-way can be retried on another decode rank.
"""

from __future__ import annotations

import asyncio
from concurrent import futures
from typing import Any

import grpc
from pdserve.kv_transfer.base import (
    CAPACITY,
    PAYLOAD,
    TRANSPORT,
    DeliveryResult,
    KVTransport,
    RankEndpoint,
)
from pdserve.rpc import kv_transfer_pb2, kv_transfer_pb2_grpc

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 16 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", 0),
]


def chunks(attempt: str, data: bytes, size: int = CHUNK_BYTES):
    view = memoryview(data)
    if not view:
        yield kv_transfer_pb2.KVChunk(request_id=attempt, data=b"")
        return
    for start in range(0, len(view), size):
        yield kv_transfer_pb2.KVChunk(request_id=attempt if start == 0 else "",
                                      data=bytes(view[start:start + size]))


# -- rank side --------------------------------------------------------------------------

class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """``Fetch`` serves the endpoint's payloads; ``Push`` imports into ``importer``
    (an object with ``import_prefilled(bytes) -> ImportResult``)."""

    def __init__(self, endpoint: RankEndpoint, importer: Any) -> None:
        self.endpoint = endpoint
        self.importer = importer

    def Fetch(self, request, context):
        data = self.endpoint.get(request.request_id)
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no KV payload for attempt {request.request_id!r} on this rank")
        yield from chunks(request.request_id, data)

    def Push(self, request_iterator, context):
        parts = [chunk.data for chunk in request_iterator]
        result = self.importer.import_prefilled(b"".join(parts))
        if not result.ok:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if result.kind == CAPACITY
                    else grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(code, result.error)
        return kv_transfer_pb2.PushResponse(request_id=result.attempt)


class GrpcEndpoint(RankEndpoint):
    """Keeps exported payloads and serves them (and imports) on a port of its own."""

    def __init__(self, importer: Any, host: str, max_age_s: float = 600.0) -> None:
        super().__init__(max_age_s)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  options=CHANNEL_OPTIONS)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(
            KVTransferServicer(self, importer), self.server)
        port = self.server.add_insecure_port(f"{host}:0")
        self.server.start()
        self.address = f"{host}:{port}"

    def export(self, attempt: str, payload: bytes) -> Any:
        super().export(attempt, payload)
        return (self.address, attempt)

    def close(self) -> None:
        self.server.stop(grace=None)
        super().close()


# -- router side ------------------------------------------------------------------------

class GrpcBytesTransport(KVTransport):
    name = "grpc"

    def __init__(self) -> None:
        super().__init__()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(
                address, options=CHANNEL_OPTIONS)
        return kv_transfer_pb2_grpc.KVTransferStub(channel)

    async def deliver(self, ticket: Any, src: Any, dst: Any) -> DeliveryResult:
        dst_address = dst.info.kv_address
        if not dst_address:
            return DeliveryResult(False, kind=TRANSPORT,
                                  error="the decode rank serves no KV endpoint")
        src_address, attempt = ticket.locator
        moved = 0

        async def relay():
            nonlocal moved
            fetch = self._stub(src_address).Fetch(kv_transfer_pb2.FetchRequest(request_id=attempt))
            async for chunk in fetch:
                moved += len(chunk.data)
                yield chunk

        try:
            reply = await self._stub(dst_address).Push(relay())
        except grpc.aio.AioRpcError as exc:
            kind = {grpc.StatusCode.RESOURCE_EXHAUSTED: CAPACITY,
                    grpc.StatusCode.INVALID_ARGUMENT: PAYLOAD}.get(exc.code(), TRANSPORT)
            return DeliveryResult(False, kind=kind, error=exc.details() or str(exc.code()))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the router cancelled the hand-off itself
            # a relay whose Fetch side was cancelled surfaces as CancelledError here
            return DeliveryResult(False, kind=TRANSPORT, error="the KV relay was cancelled")
        except Exception as exc:  # a failed relay surfaces here too (never escapes)
            return DeliveryResult(False, kind=TRANSPORT, error=f"{type(exc).__name__}: {exc}")
        self._delivered(moved)
        return DeliveryResult(True, attempt=reply.request_id, nbytes=moved)

    async def discard(self, ticket: Any, src: Any) -> None:
        try:
            await src.actor.release_kv.remote(ticket.locator[1])
        except Exception:  # a dead source holds nothing any more
            pass

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
