"""KV transports: how a prefilled payload gets from a prefill rank to a decode rank.

One folder per backend, each holding all its sides (see base.py): ``ray`` (shared
memory on one node, the object store across nodes; the default without GPUs), ``device``
(device to device: CUDA IPC on one node, else a torch.distributed pair group per
prefill/decode pair, NCCL between GPUs, gloo otherwise; the default when both pools hold GPUs, see
``RouterConfig.kv_transport`` "auto"), ``grpc`` (bytes through the router, chunked) and
``in_process`` (ranks in one process: tests). ``grpc`` authenticates every transfer with the
cluster's ``KVSecret`` (see grpc/); the others ignore ``secret``.
"""

from __future__ import annotations

from pdserve.kv_transfer.base import (
    DeliveryResult,
    EndpointSizing,
    FailureKind,
    KVSecret,
    KVTransport,
    RankEndpoint,
    RankHost,
)

TRANSPORTS = ("ray", "grpc", "device", "in_process")


def make_transport(name: str, secret: KVSecret | None = None, *,
                   timeout_s: float | None = None) -> KVTransport:
    """The router's side of transport ``name`` (``grpc`` needs the cluster's ``secret``;
    ``device`` bounds each rank's send and receive by ``timeout_s``, the router's
    hand-off timeout)."""
    if name == "ray":
        # lazy: only the backend asked for loads: the CLI and the router import this package
        from pdserve.kv_transfer.ray.transport import RayObjectStoreTransport

        return RayObjectStoreTransport()
    if name == "grpc":
        # lazy: grpc is heavy; only the grpc backend needs it
        from pdserve.kv_transfer.grpc.transport import GrpcBytesTransport

        return GrpcBytesTransport(secret)
    if name == "device":
        # lazy: only the backend asked for loads: the CLI and the router import this package
        from pdserve.kv_transfer.device.transport import DeviceTransport

        return DeviceTransport() if timeout_s is None else DeviceTransport(timeout_s)
    if name == "in_process":
        # lazy: only the backend asked for loads: the CLI and the router import this package
        from pdserve.kv_transfer.in_process.transport import InProcessTransport

        return InProcessTransport()
    raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {name!r}")


def make_endpoint(name: str, importer: RankHost, host: str, *, secret: KVSecret | None = None,
                  sizing: EndpointSizing | None = None) -> RankEndpoint:
    """A rank's side of transport ``name``, serving ``importer`` (the rank: its
    ``import_prefilled`` receives) on the node address ``host``.

    ``grpc``: without ``secret`` the endpoint refuses every request; a pushed payload is
    bounded by the longest sequence ``sizing`` allows (its default cap when unknown).
    ``ray``: ``sizing.staging_bytes`` bounds the shared memory a sender keeps for
    payloads on their way (0: none, every payload goes through the object store).
    ``device``: ``sizing.device`` is where the endpoint lends its payload tensors; its
    pair stores bind ``host``."""
    sizing = sizing or EndpointSizing()
    if name == "ray":
        # lazy: only the backend asked for loads: the CLI and the router import this package
        from pdserve.kv_transfer.ray.endpoint import RayEndpoint

        return RayEndpoint(sizing.staging_bytes, importer=importer)
    if name == "grpc":
        # lazy: grpc is heavy; only the grpc backend needs it
        from pdserve.kv_transfer.grpc.endpoint import GrpcEndpoint
        from pdserve.kv_transfer.grpc.wire import max_payload_bytes

        limit = (max_payload_bytes(sizing.max_tokens, sizing.max_tensor_bytes)
                 if sizing.max_tokens else None)
        return GrpcEndpoint(importer, host, secret, max_push_bytes=limit)
    if name == "device":
        # lazy: only the backend asked for loads: the CLI and the router import this package
        from pdserve.kv_transfer.device.endpoint import DeviceEndpoint

        return DeviceEndpoint(sizing.device, host, importer=importer)
    if name == "in_process":
        return RankEndpoint()
    raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {name!r}")


__all__ = ["DeliveryResult", "EndpointSizing", "FailureKind", "KVSecret", "KVTransport",
           "RankEndpoint", "RankHost", "TRANSPORTS", "make_endpoint", "make_transport"]
