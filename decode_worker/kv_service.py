"""The `grpc` KV transport's endpoint inside a worker: payload bytes as ~1 MiB chunks.

A prefill rank serves `Fetch` (its exported payloads, each taken once); a decode rank
serves `Push` (chunks in, one `import_prefilled` out). The router streams the chunks
from one to the other, so the bytes pass through it over gRPC, never over Ray.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from pdserve.rpc import kv_transfer_pb2, kv_transfer_pb2_grpc

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 16 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", 0),
]


def chunks(request_id: str, data: bytes, size: int = CHUNK_BYTES):
    view = memoryview(data)
    if not view:
        yield kv_transfer_pb2.KVChunk(request_id=request_id, data=b"")
        return
    for start in range(0, len(view), size):
        yield kv_transfer_pb2.KVChunk(request_id=request_id if start == 0 else "",
                                      data=bytes(view[start:start + size]))


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, rank: Any) -> None:
        self.rank = rank

    def Fetch(self, request, context):
        data = self.rank.take_kv(request.request_id)
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no KV payload for request_id {request.request_id!r} on this rank")
        yield from chunks(request.request_id, data)

    def Push(self, request_iterator, context):
        parts = []
        for chunk in request_iterator:
            parts.append(chunk.data)
        result = self.rank.import_prefilled(b"".join(parts))
        if not result["ok"]:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if result["kind"] == "capacity"
                    else grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(code, result["error"])
        return kv_transfer_pb2.PushResponse(request_id=result["request_id"])


def start_kv_server(rank: Any, host: str | None = None) -> tuple[grpc.Server, str]:
    """Serve the rank's KV endpoint on a free port; returns (server, "host:port")."""
    from pdserve.decode_worker.engine_rank import _node_ip

    host = host or _node_ip()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(rank), server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, f"{host}:{port}"
