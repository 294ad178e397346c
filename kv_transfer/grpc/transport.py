"""The ``grpc`` KV backend's router side: relays a payload from the prefill rank's
``Fetch`` to the decode rank's ``Push`` (steps 2 and 4 of this package's ``__init__``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD,
    TRANSPORT,
    DeliveryResult,
    KVSecret,
    KVTransport,
)
from pdserve.kv_transfer.grpc.wire import (
    CHANNEL_OPTIONS,
    FETCH,
    PUSH,
    SERVICE,
    STREAM_TIMEOUT_S,
    auth_metadata,
    decode_chunk,
)
from pdserve.rpc import kv_transfer_pb2


class GrpcBytesTransport(KVTransport):
    """Relays a payload from the prefill rank's ``Fetch`` to the decode rank's ``Push``,
    each call authorized with the cluster's ``secret`` (see the module docstring)."""

    name = "grpc"

    def __init__(self, secret: KVSecret | None, stream_timeout_s: float = STREAM_TIMEOUT_S) -> None:
        if not isinstance(secret, KVSecret):
            raise TypeError("the grpc KV transport needs the cluster's KVSecret "
                            "(make_transport('grpc', secret=...))")
        super().__init__()
        self._secret = secret
        self.stream_timeout_s = stream_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(
                address, options=CHANNEL_OPTIONS)
        return channel

    def _fetch(self, address: str):
        """``Fetch`` at ``address``, its chunks left serialized (relayed as they are)."""
        return self._channel(address).unary_stream(
            f"/{SERVICE}/Fetch", request_serializer=kv_transfer_pb2.FetchRequest.SerializeToString,
            response_deserializer=None)

    def _push(self, address: str):
        """``Push`` at ``address``, taking serialized chunks."""
        return self._channel(address).stream_unary(
            f"/{SERVICE}/Push", request_serializer=None,
            response_deserializer=kv_transfer_pb2.PushResponse.FromString)

    async def deliver(self, ticket: Any, src: Any, dst: Any,
                      skip_blocks: int = 0) -> DeliveryResult:
        dst_address = dst.info.kv_address
        if not dst_address:
            return DeliveryResult(False, kind=TRANSPORT,
                                  error="the decode rank serves no KV endpoint")
        src_address, attempt = ticket.locator
        moved = 0
        fetch_failed: list[Exception] = []

        async def relay():
            nonlocal moved
            fetch = self._fetch(src_address)(
                kv_transfer_pb2.FetchRequest(attempt=attempt, skip_blocks=skip_blocks),
                timeout=self.stream_timeout_s,
                metadata=auth_metadata(self._secret, FETCH, attempt, src_address))
            try:
                async for chunk in fetch:
                    moved += len(decode_chunk(chunk)[1])  # a view: the chunk is not copied
                    yield chunk
            except Exception as exc:  # gRPC then cancels the Push: say why
                fetch_failed.append(exc)
                raise

        try:
            reply = await self._push(dst_address)(
                relay(), timeout=self.stream_timeout_s,
                metadata=auth_metadata(self._secret, PUSH, attempt, dst_address))
        except grpc.aio.AioRpcError as exc:
            kind = {grpc.StatusCode.RESOURCE_EXHAUSTED: CAPACITY,
                    grpc.StatusCode.FAILED_PRECONDITION: CACHE_MISS,
                    grpc.StatusCode.INVALID_ARGUMENT: PAYLOAD}.get(exc.code(), TRANSPORT)
            return DeliveryResult(False, kind=kind, error=exc.details() or str(exc.code()))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the router cancelled the hand-off itself
            # a relay whose Fetch side failed or was cancelled surfaces as CancelledError here
            if fetch_failed:
                exc = fetch_failed[0]
                why = (exc.details() or str(exc.code()) if isinstance(exc, grpc.aio.AioRpcError)
                       else f"{type(exc).__name__}: {exc}")
                return DeliveryResult(False, kind=TRANSPORT, error=f"the KV fetch failed: {why}")
            return DeliveryResult(False, kind=TRANSPORT, error="the KV relay was cancelled")
        except Exception as exc:  # a failed relay surfaces here too (never escapes)
            return DeliveryResult(False, kind=TRANSPORT, error=f"{type(exc).__name__}: {exc}")
        self._delivered(moved)
        return DeliveryResult(True, attempt=reply.attempt, nbytes=moved)

    def held_key(self, ticket: Any) -> str | None:
        return ticket.locator[1]  # (address, attempt); freed through the base's path

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def __repr__(self) -> str:
        return f"GrpcBytesTransport({len(getattr(self, '_channels', {}))} channels, key hidden)"
