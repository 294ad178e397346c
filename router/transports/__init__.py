"""KV transports: how a prefilled payload gets from a prefill rank to a decode rank.

Every backend implements `KVTransport` (base.py), one module each:
`ray` (object store, default) and `grpc` (bytes through the router, chunked).
"""

from __future__ import annotations

from pdserve.router.transports.base import DeliveryResult, KVTransport


def make_transport(name: str) -> KVTransport:
    if name == "ray":
        from pdserve.router.transports.ray_store import RayObjectStoreTransport

        return RayObjectStoreTransport()
    if name == "grpc":
        from pdserve.router.transports.grpc_bytes import GrpcBytesTransport

        return GrpcBytesTransport()
    raise ValueError(f"kv_transport must be 'ray' or 'grpc', got {name!r}")


__all__ = ["DeliveryResult", "KVTransport", "make_transport"]
