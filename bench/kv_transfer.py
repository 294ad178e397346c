"""KV hand-off bandwidth per transport, beside a plain in-memory copy of the same bytes.

    pdserve bench kv-transfer                       # 1, 16, 64 MiB; ray and grpc
    pdserve bench kv-transfer --sizes 1,4,16,64,256 --repeats 5

Runs the real transports (`pdserve.kv_transfer`) between two small
Ray actors of this module that stand in for a prefill rank and a decode rank: the
source exports a payload exactly as an engine rank does (through the transport's
own `RankEndpoint`: `ray.put` for `ray`, kept and served over gRPC for `grpc`), this process plays
the router and calls `transport.deliver(ticket, src, dst)`, and the destination's
`import_prefilled` checks the bytes arrived intact (length, request id, a strided
checksum) without copying them again. The engine's own KV export/import (tensors to
bytes and back) is not part of this measurement.

Reported per size, medians over --repeats:
- `deliver`: bytes / time of `transport.deliver` as the router sees it;
- `handoff`: bytes / (export time inside the source + deliver time);
- `memcpy`: one copy of the same bytes between two preallocated buffers in this
  process; `memcpy_alloc`: `bytes(buf)` (allocate + copy), the cost of a fresh buffer;
- `grpc_ceiling` (with `grpc`): what gRPC itself moves here, the transport's ceiling: one
  bare client-streaming `Push` over loopback to a `grpc.aio` server in this process, with
  the transport's channel options, chunk size and serialized `KVChunk` messages, and no
  authorization, relay, checks or join (the server only counts the bytes).
Ratios are transport / memcpy, measured in the same run (shared machines are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any

from pdserve.bench.standalone import standalone_main

MIB = 1 << 20
MAGIC = b"PDKVBNCH"
HEADER = 64  # MAGIC + request id (40 bytes, padded) + length (8) + crc (8)
STRIDE = 4096
DEFAULT_SIZES = (1, 16, 64)
TRANSPORTS = ("ray", "grpc")


def make_body(request_id: str, nbytes: int, seed: int = 0) -> bytes:
    """`nbytes` bytes: a header naming the request and a checksum, then random bytes."""
    import numpy as np

    if nbytes < HEADER:
        raise ValueError(f"payload must be >= {HEADER} bytes, got {nbytes}")
    body = np.random.default_rng(seed).bytes(nbytes - HEADER)
    rid = request_id.encode()[:40].ljust(40, b"\0")
    crc = zlib.crc32(body[::STRIDE])
    return MAGIC + rid + nbytes.to_bytes(8, "little") + crc.to_bytes(8, "little") + body


def frame(request_id: str, body: bytes) -> bytes:
    """`body` framed as a KV payload (engine/kv_payload.py's prefix and header fields the
    transports read: `request_id`, `tensor_bytes`), so the gRPC service's checks apply."""
    import msgpack
    from pdserve.engine.kv_payload import _PREFIX, VERSION
    from pdserve.engine.kv_payload import MAGIC as KV_MAGIC

    header = msgpack.packb({"request_id": request_id, "tensor_bytes": len(body)},
                           use_bin_type=True)
    return b"".join([_PREFIX.pack(KV_MAGIC, VERSION, len(header)), header, body])


def make_payload(request_id: str, nbytes: int, seed: int = 0) -> bytes:
    """A framed payload whose body is `nbytes` checksummed bytes."""
    return frame(request_id, make_body(request_id, nbytes, seed))


def check_payload(payload) -> str:
    """The request id of an intact payload; ValueError otherwise."""
    import msgpack
    from pdserve.engine.kv_payload import _PREFIX

    view = memoryview(payload)
    if len(view) < _PREFIX.size:
        raise ValueError("not a KV payload")
    _, _, header_len = _PREFIX.unpack(bytes(view[:_PREFIX.size]))
    header = msgpack.unpackb(bytes(view[_PREFIX.size:_PREFIX.size + header_len]))
    view = view[_PREFIX.size + header_len:]
    if len(view) < HEADER or bytes(view[:8]) != MAGIC:
        raise ValueError("not a benchmark payload")
    rid = bytes(view[8:48]).rstrip(b"\0").decode()
    if rid != header["request_id"][:40]:
        raise ValueError(f"the header names {header['request_id']!r}, the body {rid!r}")
    n = int.from_bytes(view[48:56], "little")
    if n != len(view):
        raise ValueError(f"{rid}: {len(view)} bytes arrived, {n} were sent")
    if zlib.crc32(bytes(view[HEADER::STRIDE])) != int.from_bytes(view[56:64], "little"):
        raise ValueError(f"{rid}: checksum mismatch")
    return rid


class PayloadRank:
    """Stands in for an engine rank on either end of a hand-off (a Ray actor)."""

    def __init__(self, kv_transport: str, secret: Any = None) -> None:
        from pdserve.kv_transfer import make_endpoint

        self._payloads: dict[int, bytes] = {}
        self.endpoint = make_endpoint(kv_transport, self, "127.0.0.1", secret=secret)
        self.imported = 0

    def info(self) -> Any:
        return _Info(os.getpid(), self.endpoint.address)

    def export(self, request_id: str, nbytes: int, kv_transport: str) -> tuple[Any, float]:
        """(ticket, seconds the export took): what EngineRank._export does."""
        from pdserve.rank.messages import HandoffTicket

        base = self._payloads.get(nbytes)
        if base is None:
            base = self._payloads[nbytes] = make_body("x", nbytes)
        # Same bytes, this request's id in the headers (untimed: the engine made them).
        rid = request_id.encode()[:40].ljust(40, b"\0")
        payload = frame(request_id, base[:8] + rid + base[48:])
        start = time.perf_counter()
        locator = self.endpoint.export(request_id, payload)
        took = time.perf_counter() - start
        return HandoffTicket(request_id, 0, 0, len(payload), locator), took

    # the engine-rank methods the transports call
    def import_prefilled(self, payload) -> Any:
        from pdserve.rank.messages import ImportResult

        try:
            rid = check_payload(payload)
        except ValueError as exc:
            return ImportResult(False, kind="payload", error=str(exc))
        self.imported += 1
        return ImportResult(True, attempt=rid)

    def release_kv(self, request_id: str) -> None:
        self.endpoint.release(request_id)

    def shutdown(self) -> None:
        self.endpoint.close()


@dataclass
class _Info:
    pid: int
    kv_address: str | None


@dataclass
class _Rank:
    """What a transport needs of a rank: the actor handle and its info."""

    actor: Any
    info: Any = None


def memcpy_seconds(nbytes: int, repeats: int) -> tuple[list[float], list[float]]:
    """(copy into a preallocated buffer, allocate + copy) times for `nbytes`."""
    import numpy as np

    src = np.frombuffer(np.random.default_rng(1).bytes(nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in once
    copy, alloc = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        copy.append(time.perf_counter() - t)
        t = time.perf_counter()
        b = src.tobytes()
        alloc.append(time.perf_counter() - t)
        del b
    return copy, alloc


async def grpc_ceiling_seconds(sizes_mib: list[float], repeats: int) -> dict[float, list[float]]:
    """Seconds per size (after one warm-up) of a bare gRPC stream of that many bytes: the
    grpc transport's chunks (`encoded_chunks`: CHUNK_BYTES each) pushed over loopback
    through CHANNEL_OPTIONS to a minimal in-process `grpc.aio` server of the KV service's
    `Push`, which counts the chunks' data and answers (no MAC, relay, checks or join)."""
    import grpc
    import numpy as np
    from pdserve.kv_transfer import grpc_bytes as gb
    from pdserve.rpc import kv_transfer_pb2 as pb

    async def push(chunks, context):
        n = 0
        async for raw in chunks:
            n += len(gb.decode_chunk(raw)[1])  # a view: nothing copied
        return pb.PushResponse(request_id=str(n))

    server = grpc.aio.server(options=gb.CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(gb.SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(
            push, request_deserializer=None,
            response_serializer=pb.PushResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=gb.CHANNEL_OPTIONS)
    call = channel.stream_unary(f"/{gb.SERVICE}/Push", request_serializer=None,
                                response_deserializer=pb.PushResponse.FromString)
    out: dict[float, list[float]] = {}
    try:
        for size in sizes_mib:
            nbytes = int(size * MIB)
            data = np.random.default_rng(2).bytes(nbytes)
            times = []
            for i in range(repeats + 1):  # the first is a warm-up
                t = time.perf_counter()
                reply = await call(gb.encoded_chunks(f"ceiling-{i}", data))
                dt = time.perf_counter() - t
                if int(reply.request_id) != nbytes:
                    raise RuntimeError(f"grpc ceiling: {reply.request_id} bytes of {nbytes}")
                if i:
                    times.append(dt)
            out[size] = times
    finally:
        await channel.close()
        await server.stop(None)
    return out


async def _measure_transport(name: str, sizes_mib: list[float], repeats: int) -> dict:
    import ray
    from pdserve.kv_transfer import KVSecret, make_transport

    secret = KVSecret.generate() if name == "grpc" else None
    transport = make_transport(name, secret=secret)
    actor_cls = ray.remote(num_cpus=0)(PayloadRank)
    src_a, dst_a = actor_cls.remote(name, secret), actor_cls.remote(name, secret)
    out = {"deliver_s": {}, "export_s": {}}
    try:
        src_info, dst_info = await asyncio.gather(src_a.info.remote(), dst_a.info.remote())
        src, dst = _Rank(src_a, src_info), _Rank(dst_a, dst_info)
        for size in sizes_mib:
            nbytes = int(size * MIB)
            deliver, export = [], []
            for i in range(repeats + 1):  # the first is a warm-up
                rid = f"{name}-{size:g}-{i}"
                ticket, export_s = await src_a.export.remote(rid, nbytes, name)
                t = time.perf_counter()
                res = await transport.deliver(ticket, src, dst)
                dt = time.perf_counter() - t
                if not res.ok:
                    raise RuntimeError(f"{name} transport failed at {size:g} MiB: "
                                       f"{res.kind}: {res.error}")
                if res.nbytes and res.nbytes != ticket.nbytes:  # grpc counts what it relayed
                    raise RuntimeError(f"{name}: relayed {res.nbytes} bytes of {ticket.nbytes}")
                if res.attempt != rid:
                    raise RuntimeError(f"{name}: delivered {res.attempt!r}, sent {rid!r}")
                await transport.release(ticket, src)
                del ticket
                if i:
                    deliver.append(dt)
                    export.append(export_s)
            out["deliver_s"][size] = deliver
            out["export_s"][size] = export
    finally:
        await transport.close()
        for a in (src_a, dst_a):
            try:
                await a.shutdown.remote()
            except Exception:
                pass
            ray.kill(a, no_restart=True)
    return out


def measure(sizes_mib: list[float], transports: list[str] | tuple[str, ...] = TRANSPORTS,
            repeats: int = 3) -> dict:
    """Run the measurement (Ray must be initialised); returns the result dict."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for t in transports:
        if t not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {t!r}")
    med = statistics.median
    result: dict = {"sizes_mib": list(sizes_mib), "repeats": repeats,
                    "transports": list(transports), "bandwidth_mib_s": {}, "ratio_to_memcpy": {},
                    "seconds": {}}
    copy_bw, alloc_bw = [], []
    for size in sizes_mib:
        copy, alloc = memcpy_seconds(int(size * MIB), max(repeats, 3))
        copy_bw.append(size / med(copy))
        alloc_bw.append(size / med(alloc))
        result["seconds"].setdefault("memcpy", []).append(copy)
        result["seconds"].setdefault("memcpy_alloc", []).append(alloc)
    result["bandwidth_mib_s"]["memcpy"] = copy_bw
    result["bandwidth_mib_s"]["memcpy_alloc"] = alloc_bw
    for name in transports:
        m = asyncio.run(_measure_transport(name, list(sizes_mib), repeats))
        deliver = [size / med(m["deliver_s"][size]) for size in sizes_mib]
        handoff = [size / med([d + e for d, e in zip(m["deliver_s"][size], m["export_s"][size], strict=False)])
                   for size in sizes_mib]
        result["bandwidth_mib_s"][f"{name}_deliver"] = deliver
        result["bandwidth_mib_s"][f"{name}_handoff"] = handoff
        result["seconds"][f"{name}_deliver"] = [m["deliver_s"][s] for s in sizes_mib]
        result["seconds"][f"{name}_export"] = [m["export_s"][s] for s in sizes_mib]
        for kind, bws in (("deliver", deliver), ("handoff", handoff)):
            result["ratio_to_memcpy"][f"{name}_{kind}"] = [b / c for b, c in zip(bws, copy_bw, strict=False)]
    if "grpc" in transports:  # the grpc transport's own ceiling: gRPC alone, one hop
        ceiling_s = asyncio.run(grpc_ceiling_seconds(list(sizes_mib), repeats))
        ceiling = [size / med(ceiling_s[size]) for size in sizes_mib]
        result["bandwidth_mib_s"]["grpc_ceiling"] = ceiling
        result["seconds"]["grpc_ceiling"] = [ceiling_s[s] for s in sizes_mib]
        result["ratio_to_memcpy"]["grpc_ceiling"] = [b / c for b, c in zip(ceiling, copy_bw, strict=False)]
    return result


# ---- command line ----------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="payload sizes in MiB (default %(default)s; up to 256)")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--repeats", type=int, default=3, help="timed hand-offs per size")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: an embedded local Ray)")
    p.add_argument("--result-file", default="results/bench_kv_transfer.json")
    p.add_argument("--plot", default=None, help="PNG out (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import ray
    from pdserve.bench.serve import write_json

    sizes = [float(s) for s in args.sizes.replace(",", " ").split()]
    if not sizes or any(s <= 0 or s * MIB < HEADER for s in sizes):
        print("error: --sizes must be positive MiB values", file=sys.stderr)
        return 2
    transports = [t for t in args.transports.replace(",", " ").split()]
    started = False
    if not ray.is_initialized():
        if args.ray_address:
            ray.init(address=args.ray_address, log_to_driver=False)
        else:
            ray.init(address="local", include_dashboard=False, log_to_driver=False,
                     num_cpus=max(os.cpu_count() or 2, 4),
                     _temp_dir=os.environ.get("PDSERVE_RAY_TMP", "/tmp/pdserve-ray"))
        started = True
    try:
        result = measure(sizes, transports, args.repeats)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if started:
            ray.shutdown()
    print(format_table(result), flush=True)
    write_json(args.result_file, result)
    if not args.no_plot:
        from pdserve.bench.plots import plot_kv_transfer

        plot = args.plot or str(Path(args.result_file).with_suffix(".png"))
        plot_kv_transfer(result, plot)
        print(f"wrote {args.result_file} and {plot}")
    else:
        print(f"wrote {args.result_file}")
    return 0


def format_table(result: dict) -> str:
    names = list(result["bandwidth_mib_s"])
    lines = [f"{'MiB':>8} " + " ".join(f"{n:>16}" for n in names) + "   (MiB/s, median)"]
    for i, size in enumerate(result["sizes_mib"]):
        lines.append(f"{size:>8g} " + " ".join(
            f"{result['bandwidth_mib_s'][n][i]:>16.0f}" for n in names))
    lines.append("ratio to memcpy:")
    for name, ratios in result["ratio_to_memcpy"].items():
        lines.append(f"  {name:<16} " + " ".join(f"{r:.3f}" for r in ratios))
    return "\n".join(lines)


main = standalone_main(__doc__, add_args, run)


if __name__ == "__main__":
    sys.exit(main())
