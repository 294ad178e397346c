"""KV as bytes through the router over gRPC: pull ~1 MiB chunks from the prefill
rank's KV service and push them, as they arrive, to the decode rank's."""

from __future__ import annotations

from typing import Any

import grpc
from pdserve.router.transports.base import DeliveryResult, KVTransport
from pdserve.rpc import kv_transfer_pb2, kv_transfer_pb2_grpc

MAX_MESSAGE_BYTES = 16 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", 0),
]


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
        dst_address = dst.info.get("kv_address")
        if not dst_address:
            return DeliveryResult(False, kind="transport",
                                  error="the decode rank serves no KV endpoint")
        moved = 0

        async def relay():
            nonlocal moved
            fetch = self._stub(ticket["address"]).Fetch(
                kv_transfer_pb2.FetchRequest(request_id=ticket["request_id"]))
            async for chunk in fetch:
                moved += len(chunk.data)
                yield chunk

        try:
            reply = await self._stub(dst_address).Push(relay())
        except grpc.aio.AioRpcError as exc:
            kind = {grpc.StatusCode.RESOURCE_EXHAUSTED: "capacity",
                    grpc.StatusCode.INVALID_ARGUMENT: "payload"}.get(exc.code(), "transport")
            return DeliveryResult(False, kind=kind, error=exc.details() or str(exc.code()))
        self.bytes_moved += moved
        self.num_deliveries += 1
        return DeliveryResult(True, request_id=reply.request_id, nbytes=moved)

    async def discard(self, ticket: Any, src: Any) -> None:
        try:
            await src.actor.discard_kv.remote(ticket["request_id"])
        except Exception:  # a dead source holds nothing any more
            pass

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
