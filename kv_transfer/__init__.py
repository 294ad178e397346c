"""KV transports: how a prefilled payload gets from a prefill rank to a decode rank.

One module per backend, each holding all its sides (see base.py): ``ray`` (shared
memory on one node, the object store across nodes; the default without GPUs), ``device``
(device to device over a torch.distributed pair group per prefill/decode pair: NCCL
between GPUs, gloo otherwise; the default when both pools hold GPUs, see
``RouterConfig.kv_transport`` "auto"), ``grpc`` (bytes through the router, chunked) and
``in_process`` (ranks in one process: tests). ``grpc`` authenticates every transfer with the
cluster's ``KVSecret`` (see grpc_bytes.py); the others ignore ``secret``.
"""

from __future__ import annotations

from typing import Any

from pdserve.kv_transfer.base import (
    DeliveryResult,
    FailureKind,
    KVSecret,
    KVTransport,
    RankEndpoint,
)

TRANSPORTS = ("ray", "grpc", "device", "in_process")


def make_transport(name: str, secret: KVSecret | None = None, *,
                   timeout_s: float | None = None) -> KVTransport:
    """The router's side of transport ``name`` (``grpc`` needs the cluster's ``secret``;
    ``device`` bounds each rank's send and receive by ``timeout_s``, the router's
    hand-off timeout)."""
    if name == "ray":
        from pdserve.kv_transfer.ray_store import RayObjectStoreTransport

        return RayObjectStoreTransport()
    if name == "grpc":
        from pdserve.kv_transfer.grpc_bytes import GrpcBytesTransport

        return GrpcBytesTransport(secret)
    if name == "device":
        from pdserve.kv_transfer.torch_dist import DeviceTransport

        return DeviceTransport() if timeout_s is None else DeviceTransport(timeout_s)
    if name == "in_process":
        from pdserve.kv_transfer.in_process import InProcessTransport

        return InProcessTransport()
    raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {name!r}")


def make_endpoint(name: str, importer: Any, host: str, *, secret: KVSecret | None = None,
                  max_push_bytes: int | None = None, staging_bytes: int = 0,
                  device: str | None = None) -> RankEndpoint:
    """A rank's side of transport ``name``; ``importer.import_prefilled`` receives.

    ``grpc``: without ``secret`` the endpoint refuses every request; ``max_push_bytes``
    bounds a pushed payload (default: ``grpc_bytes.DEFAULT_MAX_PUSH_BYTES``).
    ``ray``: ``staging_bytes`` bounds the shared memory a sender keeps for payloads on
    their way (0: none, every payload goes through the object store).
    ``device``: the engine's device (``"cpu"``, ``"cuda:0"``), where the ``device``
    endpoint lends its payload tensors; its pair stores bind ``host``."""
    if name == "ray":
        from pdserve.kv_transfer.ray_store import RayEndpoint

        return RayEndpoint(staging_bytes)
    if name == "grpc":
        from pdserve.kv_transfer.grpc_bytes import GrpcEndpoint

        return GrpcEndpoint(importer, host, secret, max_push_bytes=max_push_bytes)
    if name == "device":
        from pdserve.kv_transfer.torch_dist import DeviceEndpoint

        return DeviceEndpoint(device or "cpu", host)
    if name == "in_process":
        return RankEndpoint()
    raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {name!r}")


__all__ = ["DeliveryResult", "FailureKind", "KVSecret", "KVTransport", "RankEndpoint", "TRANSPORTS",
           "make_endpoint", "make_transport"]
