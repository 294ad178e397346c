"""KV hand-off bandwidth per transport, beside a plain in-memory copy of the same bytes.

    pdserve bench kv-transfer                       # 1, 16, 64 MiB; ray and grpc
    pdserve bench kv-transfer --sizes 1,4,16,64,256 --repeats 5
    pdserve bench kv-transfer --ray-address HOST:PORT --across-nodes   # rank on two nodes

Runs the real transports (`pdserve.kv_transfer`) between two Ray actors of this module
that stand in for a prefill rank and a decode rank, each with a real KV cache of the
built-in model's shape: the source lays a payload out and gathers a prompt's scattered
blocks straight into the buffer its transport lends (`write_payload`, as the engine
does; `ray`: a shared-memory segment, `grpc`: its own buffer, served over gRPC), this
process plays the router and calls `transport.deliver(ticket, src, dst)`, and the
destination parses the payload and scatters it into its own blocks (as a decode rank
does; a checksum of the blocks it wrote is compared with the source's). Only the model
and the scheduler are left out.

Reported per size, medians over --repeats:
- `deliver`: bytes / time of `transport.deliver` as the router sees it;
- `handoff`: bytes / (export time inside the source + deliver time): export + deliver +
  import, the whole hand-off;
- `memcpy`: one copy of the same bytes between two preallocated buffers in this
  process; `memcpy_alloc`: `bytes(buf)` (allocate + copy), the cost of a fresh buffer;
- `grpc_ceiling` (with `grpc`): what gRPC itself moves here, the transport's ceiling: one
  bare client-streaming `Push` over loopback to a `grpc.aio` server in this process, with
  the transport's channel options, chunk size and serialized `KVChunk` messages, and no
  authorization, relay, checks or join (the server only counts the bytes).
Ratios are transport / memcpy, measured in the same run (shared machines are noisy).
With ``--across-nodes`` the two ranks sit on different nodes of the cluster joined: the
``ray`` transport then takes its object path (Ray's node-to-node transfer; the
destination's import paths are counted and printed), ``grpc`` its relay between nodes.

The stand-in ranks are `kv_payload_rank.py`; the hand-off's share of the time to the
second token (``--prompt-tokens``) is measured by `kv_handoff_share.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from pdserve.bench.kv_handoff_share import LONG_CONTEXT, format_share, measure_handoff_share
from pdserve.bench.kv_payload_rank import BLOCK_BYTES, PayloadRank
from pdserve.bench.plots import plot_kv_transfer
from pdserve.bench.serve_report import write_json
from pdserve.bench.standalone import standalone_main
from pdserve.engine.config import DEFAULT_KV_COPY_THREADS
from pdserve.kv_transfer import KVSecret, make_transport
from pdserve.kv_transfer.grpc import wire as grpc_wire
from pdserve.kv_transfer.ray import transport as ray_transport
from pdserve.router.embedded_ray import idle_openmp_passively
from pdserve.rpc import kv_transfer_pb2 as pb

MIB = 1 << 20
DEFAULT_SIZES = (1, 16, 64)
TRANSPORTS = ("ray", "grpc")
DEFAULT_REPEATS = 5  # timed hand-offs per size
WARMUPS = 2  # untimed ones before them


@dataclass
class _Rank:
    """What a transport needs of a rank: the actor handle and its info."""

    actor: Any
    info: Any = None


def memcpy_seconds(nbytes: int, repeats: int) -> tuple[list[float], list[float]]:
    """(copy into a preallocated buffer, allocate + copy) times for `nbytes`."""
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
    async def push(chunks, context):
        n = 0
        async for raw in chunks:
            n += len(grpc_wire.decode_chunk(raw)[1])  # a view: nothing copied
        return pb.PushResponse(attempt=str(n))

    server = grpc.aio.server(options=grpc_wire.CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(grpc_wire.SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(
            push, request_deserializer=None,
            response_serializer=pb.PushResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_wire.CHANNEL_OPTIONS)
    call = channel.stream_unary(f"/{grpc_wire.SERVICE}/Push", request_serializer=None,
                                response_deserializer=pb.PushResponse.FromString)
    out: dict[float, list[float]] = {}
    try:
        for size in sizes_mib:
            nbytes = int(size * MIB)
            data = np.random.default_rng(2).bytes(nbytes)
            times = []
            for i in range(repeats + 1):  # the first is a warm-up
                t = time.perf_counter()
                reply = await call(grpc_wire.encoded_chunks(f"ceiling-{i}", data))
                dt = time.perf_counter() - t
                if int(reply.attempt) != nbytes:
                    raise RuntimeError(f"grpc ceiling: {reply.attempt} bytes of {nbytes}")
                if i:
                    times.append(dt)
            out[size] = times
    finally:
        await channel.close()
        await server.stop(None)
    return out


def two_nodes() -> tuple[str, str]:
    """Two alive nodes of the cluster this process joined (the first is its own when it
    has one); ValueError on a single-node cluster."""
    # lazy: ray is heavy; only a run needs it (`pdserve --help` imports this module)
    import ray

    own = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n.get("Alive")),
                   key=lambda n: n != own)
    if len(nodes) < 2:
        raise ValueError("--across-nodes needs a Ray cluster of two nodes or more "
                         "(--ray-address); this one has one")
    return nodes[0], nodes[1]


def _stand_in_classes(across_nodes: bool) -> tuple[Any, Any]:
    """The source's and the destination's actor classes (on two nodes with
    ``across_nodes``)."""
    # lazy: ray is heavy; only a run needs it
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(num_cpus=0)(PayloadRank)
    if not across_nodes:
        return actor_cls, actor_cls
    # the source on one node, the destination on another
    src_cls, dst_cls = (actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)) for node in two_nodes())
    return src_cls, dst_cls


def _check_delivery(name: str, size: float, rid: str, ticket: Any, res: Any) -> None:
    """A failed delivery, or one of other bytes or another payload, ends the run."""
    if not res.ok:
        raise RuntimeError(f"{name} transport failed at {size:g} MiB: "
                           f"{res.kind}: {res.error}")
    if res.nbytes and res.nbytes != ticket.nbytes:  # grpc counts what it relayed
        raise RuntimeError(f"{name}: relayed {res.nbytes} bytes of {ticket.nbytes}")
    if res.attempt != rid:
        raise RuntimeError(f"{name}: delivered {res.attempt!r}, sent {rid!r}")


async def _timed_handoffs(name: str, size: float, repeats: int, transport: Any, src: _Rank,
                          dst: _Rank) -> tuple[list[float], list[float]]:
    """(deliver seconds, export seconds) of ``repeats`` hand-offs of ``size`` MiB."""
    nbytes = int(size * MIB)
    deliver, export = [], []
    # the first WARMUPS are untimed: the first import makes the destination's
    # cache, and the next few still ran 2-4x slower here (fresh mappings, the
    # actors' own start-up still on the 2 cores)
    for i in range(repeats + WARMUPS):
        rid = f"{name}-{size:g}-{i}"
        ticket, export_s, sent = await src.actor.export.remote(rid, nbytes, name)
        t = time.perf_counter()
        res = await transport.deliver(ticket, src, dst)
        dt = time.perf_counter() - t
        _check_delivery(name, size, rid, ticket, res)
        if await dst.actor.checksum.remote(rid) != sent:
            raise RuntimeError(f"{name}: the KV blocks of {rid} arrived changed")
        await transport.release(ticket, src)
        del ticket
        if i >= WARMUPS:
            deliver.append(dt)
            export.append(export_s)
    return deliver, export


async def _shut_down(actors: tuple[Any, ...]) -> None:
    # lazy: ray is heavy; only a run needs it
    import ray

    for a in actors:
        try:
            await a.shutdown.remote()
        except Exception:
            pass
        ray.kill(a, no_restart=True)


async def _measure_transport(name: str, sizes_mib: list[float], repeats: int,
                             copy_threads: int, across_nodes: bool = False) -> dict:
    src_cls, dst_cls = _stand_in_classes(across_nodes)
    secret = KVSecret.generate() if name == "grpc" else None
    transport = make_transport(name, secret=secret)
    # the source stages up to two payloads of the largest size (ray: shared memory)
    staging = 2 * int(max(sizes_mib) * MIB) + (4 << 20)
    src_a = src_cls.remote(name, secret, staging, copy_threads)
    dst_a = dst_cls.remote(name, secret, 0, copy_threads)
    out: dict = {"deliver_s": {}, "export_s": {}}
    try:
        src_info, dst_info = await asyncio.gather(src_a.info.remote(), dst_a.info.remote())
        src, dst = _Rank(src_a, src_info), _Rank(dst_a, dst_info)
        for size in sizes_mib:
            out["deliver_s"][size], out["export_s"][size] = await _timed_handoffs(
                name, size, repeats, transport, src, dst)
        out["nodes"] = len({src_info.node_id, dst_info.node_id})
        out["import_paths"] = await dst_a.paths.remote()
    finally:
        await transport.close()
        await _shut_down((src_a, dst_a))
    return out


def measure(sizes_mib: list[float], transports: list[str] | tuple[str, ...] = TRANSPORTS,
            repeats: int = DEFAULT_REPEATS, copy_threads: int = DEFAULT_KV_COPY_THREADS,
            across_nodes: bool = False) -> dict:
    """Run the measurement (Ray must be initialised); returns the result dict. The
    stand-in ranks copy blocks with ``copy_threads`` threads, as an engine does with
    its ``kv_copy_threads``; the memcpy baseline is always one thread (in this process).
    ``across_nodes``: the two ranks on different nodes of the cluster, the paths named
    ``<transport>_across_nodes_...``."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for t in transports:
        if t not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {t!r}")
    med = statistics.median
    result: dict = {"sizes_mib": list(sizes_mib), "repeats": repeats,
                    "transports": list(transports), "bandwidth_mib_s": {}, "ratio_to_memcpy": {},
                    "seconds": {}, "copy_threads": copy_threads, "across_nodes": across_nodes,
                    "import_paths": {}}
    copy_bw, alloc_bw = [], []
    for size in sizes_mib:
        copy, alloc = memcpy_seconds(int(size * MIB), max(repeats, 3))
        copy_bw.append(size / med(copy))
        alloc_bw.append(size / med(alloc))
        result["seconds"].setdefault("memcpy", []).append(copy)
        result["seconds"].setdefault("memcpy_alloc", []).append(alloc)
    result["bandwidth_mib_s"]["memcpy"] = copy_bw
    result["bandwidth_mib_s"]["memcpy_alloc"] = alloc_bw
    for transport in transports:
        m = asyncio.run(_measure_transport(transport, list(sizes_mib), repeats, copy_threads,
                                           across_nodes))
        name = f"{transport}_across_nodes" if across_nodes else transport
        if across_nodes and m["nodes"] < 2:
            raise RuntimeError(f"{transport}: both ranks landed on one node")
        result["import_paths"][name] = m["import_paths"]
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


def copies_per_path() -> dict[str, dict[str, int]]:
    """Copies of the KV bytes per transport path, as each transport's docstring counts."""
    return {"ray": dict(ray_transport.COPIES), "grpc": dict(grpc_wire.COPIES)}


# ---- command line ----------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="payload sizes in MiB (default %(default)s; up to 256)")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"timed hand-offs per size (after {WARMUPS} untimed ones)")
    p.add_argument("--copy-threads", type=int, default=DEFAULT_KV_COPY_THREADS,
                   help="threads of the stand-in ranks' block copies (an engine's "
                   "kv_copy_threads; default %(default)s); the memcpy baseline is one thread")
    p.add_argument("--prompt-tokens", default="1024,4096,16384",
                   help="prompt lengths for the hand-off's share of the time to the second "
                   "token, through the service with KV streaming on and off ('none': skip)")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="prefill tokens per step for those (a prompt streams one chunk a step)")
    p.add_argument("--share-repeats", type=int, default=3, help="requests per prompt length")
    p.add_argument("--share-model-size", choices=["tiny", "small"], default="tiny",
                   help="the built-in model's size for those (small: 768 x 12 layers, 24 KiB "
                   "of KV a token)")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: an embedded local Ray)")
    p.add_argument("--across-nodes", action="store_true",
                   help="put the two stand-in ranks on different nodes of that cluster (two "
                   "nodes or more): the ray transport's object path, Ray's node-to-node "
                   "transfer; grpc's bytes relayed by this process between the nodes")
    p.add_argument("--result-file", default="results/bench_kv_transfer.json")
    p.add_argument("--plot", default=None, help="PNG out (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true")


def _share_tokens(text: str) -> list[int] | None:
    """--prompt-tokens' lengths (None for 'none'; [0], refused, for what is not a count)."""
    if text.strip().lower() in ("", "none"):
        return None
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        return [0]


def _argument_error(args: argparse.Namespace, sizes: list[float],
                    share_tokens: list[int] | None) -> str | None:
    if not sizes or any(s * MIB < BLOCK_BYTES for s in sizes):
        return f"--sizes must be MiB values of at least one block ({BLOCK_BYTES / MIB:g} MiB)"
    if not 1 <= args.copy_threads <= 64:
        return f"--copy-threads must be in [1, 64], got {args.copy_threads}"
    if share_tokens is not None and (any(not 16 <= t <= LONG_CONTEXT - 64 for t in share_tokens)
                         or args.chunk_tokens < 16):
        return (f"--prompt-tokens must be token counts in [16, {LONG_CONTEXT - 64}] "
                "(or 'none'), --chunk-tokens >= 16")
    return None


def _start_ray(ray_address: str | None) -> bool:
    """Joins ``ray_address``'s cluster, or starts a local Ray, unless this process has
    one already; whether it did (and so shuts it down)."""
    # lazy: ray is heavy; only a run needs it
    import ray

    if ray.is_initialized():
        return False
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 num_cpus=max(os.cpu_count() or 2, 4),
                 _temp_dir=os.environ.get("PDSERVE_RAY_TMP", "/tmp/pdserve-ray"))
    return True


def _write_results(args: argparse.Namespace, result: dict) -> None:
    write_json(args.result_file, result)
    if not args.no_plot:
        plot = args.plot or str(Path(args.result_file).with_suffix(".png"))
        plot_kv_transfer(result, plot)
        print(f"wrote {args.result_file} and {plot}")
    else:
        print(f"wrote {args.result_file}")


def run(args: argparse.Namespace) -> int:
    idle_openmp_passively()  # the stand-in ranks idle their copy threads as ranks do
    # lazy: ray is heavy; only a run needs it
    import ray

    sizes = [float(s) for s in args.sizes.replace(",", " ").split()]
    transports = [t for t in args.transports.replace(",", " ").split()]
    share_tokens = _share_tokens(args.prompt_tokens)
    error = _argument_error(args, sizes, share_tokens)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    started = _start_ray(args.ray_address)
    try:
        result = measure(sizes, transports, args.repeats, args.copy_threads, args.across_nodes)
        result["copies"] = copies_per_path()
        if share_tokens:
            print("the hand-off's share of the time to the second token ...", flush=True)
            result["handoff_share"] = measure_handoff_share(
                share_tokens, args.share_repeats, args.chunk_tokens, args.share_model_size)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if started:
            ray.shutdown()
    print(format_table(result), flush=True)
    if "handoff_share" in result:
        print(format_share(result["handoff_share"]), flush=True)
    _write_results(args, result)
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
    for transport, paths in result.get("copies", {}).items():
        lines.append(f"copies of the KV bytes, {transport}: " + "; ".join(
            f"{path}: {n}" for path, n in paths.items()))
    for name, paths in result.get("import_paths", {}).items():
        if name.startswith("ray"):
            lines.append(f"imports on the destination, {name}: " + "; ".join(
                f"{path}: {n}" for path, n in paths.items()))
    return "\n".join(lines)


main = standalone_main(__doc__, add_args, run)


if __name__ == "__main__":
    sys.exit(main())
