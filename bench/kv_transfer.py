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
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from pdserve.bench.standalone import standalone_main
from pdserve.engine.config import DEFAULT_KV_COPY_THREADS

MIB = 1 << 20
DEFAULT_SIZES = (1, 16, 64)
TRANSPORTS = ("ray", "grpc")
DEFAULT_REPEATS = 5  # timed hand-offs per size
WARMUPS = 2  # untimed ones before them


# The stand-in ranks' KV cache: the built-in tiny model's shape (4 layers, 2 KV heads of
# 64 dims, fp32, 16-token blocks): 64 KiB a block, 4 KiB a token.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 16
BLOCK_BYTES = 2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4


def num_blocks_for(nbytes: int) -> int:
    return max(1, nbytes // BLOCK_BYTES)


def kv_cache(num_blocks: int, seed: int | None, copy_threads: int = 1):
    """A KV cache of ``num_blocks`` usable blocks (random contents with ``seed``),
    copying blocks in and out with ``copy_threads`` threads."""
    import torch

    from pdserve.kernels.kv_cache import KVCache

    cache = KVCache(LAYERS, KV_HEADS, HEAD_DIM, num_blocks + 1, BLOCK_SIZE,
                    copy_threads=copy_threads)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in (*cache.k_blocks, *cache.v_blocks):
            layer.copy_(torch.randn(layer.shape, generator=g))
    return cache


def block_checksum(cache, block_ids: list[int]) -> float:
    """What arrived, cheaply: the sum of K and V of the first and last of ``block_ids``."""
    ends = [block_ids[0], block_ids[-1]]
    return float(sum(layer[ends].double().sum() for layer in (*cache.k_blocks, *cache.v_blocks)))


class PayloadRank:
    """Stands in for an engine rank on either end of a hand-off (a Ray actor), with a
    real KV cache: the source gathers a prompt's blocks into the buffer its transport
    lends (``write_payload``, as the engine does), the destination parses the payload
    and scatters it into its own blocks (``KVCache.import_sequence``), as a decode rank
    does; only the model and the scheduler are left out."""

    def __init__(self, kv_transport: str, secret: Any = None, staging_bytes: int = 0,
                 copy_threads: int = 1) -> None:
        from pdserve.kv_transfer import make_endpoint

        self.copy_threads = copy_threads
        self.endpoint = make_endpoint(kv_transport, self, "127.0.0.1", secret=secret,
                                      staging_bytes=staging_bytes)
        self._cache: Any = None
        self._tables: dict[str, list[int]] = {}
        self._table_cache: dict[tuple[int, int], list[int]] = {}
        self.imported = 0
        # how payloads reached this rank: mapped from the sender's segment (one node), or
        # as an object Ray resolved (another node, or one that could not be staged)
        self.import_paths = {"shared memory": 0, "object": 0}
        # asked by the router's transport through a local socket on one node, as a
        # decode rank is (kv_transfer/wake_channel.py), else by a Ray call
        self.wake_address = ""
        if hasattr(self.endpoint, "listen_for_wakes"):
            self.wake_address = self.endpoint.listen_for_wakes(lambda locator: None,
                                                               self.import_shared)

    def info(self) -> Any:
        node_id = ""
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        except Exception:
            pass
        return _Info(os.getpid(), self.endpoint.address, node_id, self.wake_address)

    def _cache_for(self, num_blocks: int, seed: int | None):
        if self._cache is None or self._cache.num_blocks - 1 < num_blocks:
            self._cache = kv_cache(num_blocks, seed, self.copy_threads)
        return self._cache

    def _table(self, num_blocks: int, seed: int) -> list[int]:
        """A block table of ``num_blocks`` shuffled ids (the same for the same seed).
        Made once per size: it stands in for the scheduler's allocation, which is left
        out, and shuffling 4096 ids costs ~2 ms, inside the destination's timed import."""
        import random

        key = (num_blocks, seed)
        if key not in self._table_cache:
            ids = list(range(1, num_blocks + 1))
            random.Random(seed).shuffle(ids)  # a prompt's blocks lie anywhere in the pool
            self._table_cache[key] = ids
        return self._table_cache[key]

    def export(self, request_id: str, nbytes: int, kv_transport: str) -> tuple[Any, float, float]:
        """(ticket, seconds the export took, checksum of what it sent): what the engine's
        hand-off and EngineRank._export do."""
        from pdserve.engine.kv_payload import KVPayload, write_payload
        from pdserve.rank.messages import HandoffTicket

        n = num_blocks_for(nbytes)
        cache = self._cache_for(n, seed=0)
        table = self._table(n, seed=len(request_id))
        tokens = n * BLOCK_SIZE
        payload = KVPayload(request_id, "bench", "float32", BLOCK_SIZE, LAYERS,
                            token_ids=[7] * tokens + [8], num_prompt_tokens=tokens, sampling={})
        start = time.perf_counter()
        buffer = write_payload(payload, cache, table, 0, tokens, self.endpoint.payload_buffer,
                               request_id)
        locator = self.endpoint.export(request_id, buffer)
        took = time.perf_counter() - start
        return (HandoffTicket(request_id, 0, tokens, len(buffer), locator), took,
                block_checksum(cache, table))

    # the engine-rank methods the transports call
    def import_prefilled(self, payload, borrowed: bool = False, skip_blocks: int = 0) -> Any:
        from pdserve.engine.kv_payload import KVPayload, KVPayloadError
        from pdserve.rank.messages import ImportResult

        try:
            kv = KVPayload.from_bytes(payload)
        except KVPayloadError as exc:
            return ImportResult(False, kind="payload", error=str(exc))
        n = kv.tensors["k_blocks"].shape[1]
        cache = self._cache_for(n, seed=None)
        table = self._table(n, seed=7)
        cache.import_sequence(table, 0, kv.tensors)
        self._tables[kv.request_id] = table
        self.imported += 1
        self.import_paths["shared memory" if borrowed else "object"] += 1
        return ImportResult(True, attempt=kv.request_id, nbytes=len(payload))

    def paths(self) -> dict[str, int]:
        return dict(self.import_paths)

    def import_shared(self, locator, skip_blocks: int = 0) -> Any:
        from pdserve.rank.messages import ImportResult

        try:
            view = self.endpoint.open_shared(locator)
        except OSError as exc:
            return ImportResult(False, kind="unreachable", error=str(exc))
        result = self.import_prefilled(view, borrowed=True)
        if result.ok and not self.endpoint.still_valid(locator):
            return ImportResult(False, kind="transport", error="segment reused while read")
        return result

    def kv_object(self, attempt: str, skip_blocks: int = 0) -> Any:
        return self.endpoint.object_for(attempt, skip_blocks)

    def checksum(self, request_id: str) -> float:
        return block_checksum(self._cache, self._tables.pop(request_id))

    def release_kv(self, request_id: str) -> None:
        self.endpoint.release(request_id)

    def shutdown(self) -> None:
        self.endpoint.close()


@dataclass
class _Info:
    pid: int
    kv_address: str | None
    node_id: str = ""
    wake_address: str = ""


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


def two_nodes() -> tuple[str, str]:
    """Two alive nodes of the cluster this process joined (the first is its own when it
    has one); ValueError on a single-node cluster."""
    import ray

    own = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n.get("Alive")),
                   key=lambda n: n != own)
    if len(nodes) < 2:
        raise ValueError("--across-nodes needs a Ray cluster of two nodes or more "
                         "(--ray-address); this one has one")
    return nodes[0], nodes[1]


async def _measure_transport(name: str, sizes_mib: list[float], repeats: int,
                             copy_threads: int, across_nodes: bool = False) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pdserve.kv_transfer import KVSecret, make_transport

    actor_cls = ray.remote(num_cpus=0)(PayloadRank)
    src_cls = dst_cls = actor_cls
    if across_nodes:  # the source on one node, the destination on another
        src_cls, dst_cls = (actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node, soft=False)) for node in two_nodes())
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
            nbytes = int(size * MIB)
            deliver, export = [], []
            # the first WARMUPS are untimed: the first import makes the destination's
            # cache, and the next few still ran 2-4x slower here (fresh mappings, the
            # actors' own start-up still on the 2 cores)
            for i in range(repeats + WARMUPS):
                rid = f"{name}-{size:g}-{i}"
                ticket, export_s, sent = await src_a.export.remote(rid, nbytes, name)
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
                if await dst_a.checksum.remote(rid) != sent:
                    raise RuntimeError(f"{name}: the KV blocks of {rid} arrived changed")
                await transport.release(ticket, src)
                del ticket
                if i >= WARMUPS:
                    deliver.append(dt)
                    export.append(export_s)
            out["deliver_s"][size] = deliver
            out["export_s"][size] = export
        out["nodes"] = len({src_info.node_id, dst_info.node_id})
        out["import_paths"] = await dst_a.paths.remote()
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


# ---- the hand-off's share of the time to the second token --------------------------------

LONG_CONTEXT = 32768  # the built-in model, copied with a context that fits 16k prompts


def long_context_model(size: str = "tiny") -> str:
    """The built-in model (``size``: tiny, or small: 768 x 12 layers) with a context of
    LONG_CONTEXT (same weights otherwise), made once into the model cache."""
    from pdserve.engine.model_catalog import tiny_model_dir
    from pdserve.engine.tiny_model import make_tiny_model

    path = tiny_model_dir().with_name(f"{size}-llama-{LONG_CONTEXT}")
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, size=size, max_position_embeddings=LONG_CONTEXT)
    return str(path)


def _share_config(model_dir: str, max_tokens: int, chunk_tokens: int, folder: str) -> str:
    """A `pdserve serve --config` file: 1 prefill + 1 decode rank that hold one such
    prompt, prefilling ``chunk_tokens`` a step."""
    import json
    from pathlib import Path

    engine = dict(num_kv_blocks=max_tokens // 16 + 64, max_num_seqs=4, block_size=16,
                  max_num_batched_tokens=chunk_tokens, max_model_len=max_tokens + 64)
    config = {"model_dir": model_dir, "engine": engine,
              "prefill": {"replicas": 1, "num_cpus": 0.5, "resources": {"prefill": 1}},
              "decode": {"replicas": 1, "num_cpus": 0.5, "resources": {"decode": 1}}}
    path = Path(folder) / "share.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def _time_to_second_token(address: str, prompt: list[int]) -> dict:
    from pdserve.router.client import Client

    # More tokens than the two timed: with a direct hand-off the decode rank starts at
    # once, and a request that ended before the router had booked its delivery would
    # carry no delivery time in its timings.
    max_tokens = 8
    with Client(address, timeout=600) as client:
        start = time.perf_counter()
        stamps, last = [], None
        for msg in client.stream(prompt, max_tokens=max_tokens, temperature=0,
                                 ignore_eos=True):
            now = time.perf_counter()
            stamps += [now] * len(msg.token_ids)
            last = msg
    if last is None or last.finish_reason != "length" or len(stamps) != max_tokens:
        raise RuntimeError(f"a {len(prompt)}-token prompt did not give {max_tokens} tokens: "
                           f"{getattr(last, 'finish_reason', None)} {getattr(last, 'error', '')}")
    t = last.timings
    # The hand-off whole (kv_handoff_span_ms): from the first token sampled on the prefill
    # rank to the decode rank's import done, on the two ranks' clocks (one node): the
    # export, the report to the router, its delivery and the import. Its parts as the
    # ranks and the router time them: export (the prefill rank's gather into its
    # transport's buffer) and deliver (the router's delivery, the import inside it).
    if t.kv_handoff_span_ms <= 0:
        raise RuntimeError("the router did not time the hand-off's span (kv_handoff_span_ms)")
    return {"ttft_s": stamps[0] - start, "ttst_s": stamps[1] - start,
            "first_to_second_s": stamps[1] - stamps[0],
            "export_s": t.kv_export_ms / 1e3, "deliver_s": t.kv_handoff_ms / 1e3,
            "handoff_s": t.kv_handoff_span_ms / 1e3, "kv_bytes": t.kv_bytes}


def measure_handoff_share(prompt_tokens: list[int], repeats: int, chunk_tokens: int = 512,
                          model_size: str = "tiny") -> dict:
    """Per prompt length, with KV streaming on and off (two `pdserve serve` processes of
    1 prefill + 1 decode rank, ray transport, side by side, alternating; fresh random
    prompts: no cache hits): the time to the first and second token at a client, the
    router's hand-off time, and the hand-off's share of the time to the second token."""
    import contextlib
    import random
    import tempfile

    from pdserve.bench.compare_modes import subprocess_router

    model = long_context_model(model_size)
    rng = random.Random(0)
    modes = {"streamed": (), "whole": ("--no-kv-streaming",)}
    runs: dict = {mode: {n: [] for n in prompt_tokens} for mode in modes}
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        config = _share_config(model, max(prompt_tokens), chunk_tokens, folder)
        addresses = {mode: stack.enter_context(subprocess_router(
            {"mode": "disaggregated", "prefill": 1, "decode": 1}, model=model,
            extra_args=("--config", config, *flags))) for mode, flags in modes.items()}
        for n in prompt_tokens:
            for i in range(repeats + 1):  # the first of each is a warm-up
                for mode, address in addresses.items():
                    prompt = [1] + [rng.randrange(3, 4000) for _ in range(n - 1)]
                    row = _time_to_second_token(address, prompt)
                    if i:
                        runs[mode][n].append(row)
            print(f"  {n} tokens: done", flush=True)
    med = statistics.median
    out: dict = {"prompt_tokens": list(prompt_tokens), "chunk_tokens": chunk_tokens,
                 "repeats": repeats, "model_size": model_size, "modes": {}}
    for mode, by_n in runs.items():
        rows = out["modes"][mode] = {}
        for key in ("ttft_s", "ttst_s", "first_to_second_s", "export_s", "deliver_s",
                    "handoff_s", "kv_bytes"):
            rows[key] = [med(r[key] for r in by_n[n]) for n in prompt_tokens]
        rows["handoff_share_of_ttst"] = [med(r["handoff_s"] / r["ttst_s"] for r in by_n[n])
                                         for n in prompt_tokens]
        rows["requests"] = [by_n[n] for n in prompt_tokens]  # every timed request, in order
    return out


def format_share(share: dict) -> str:
    lines = [f"hand-off share of the time to the second token ({share['model_size']} model, "
             f"prefill chunks of {share['chunk_tokens']} tokens; medians, ms; hand-off = "
             "first token sampled -> imported on the decode rank (export, report, deliver, "
             "import); streamed: the last payload's, its chunks went during the prefill):",
             f"{'tokens':>8} {'mode':>9} {'TTFT':>8} {'to 2nd':>8} {'1st->2nd':>9} "
             f"{'export':>7} {'deliver':>8} {'hand-off':>9} {'share':>6} {'KV MiB':>7}"]
    for i, n in enumerate(share["prompt_tokens"]):
        for mode, rows in share["modes"].items():
            lines.append(f"{n:>8} {mode:>9} {1e3 * rows['ttft_s'][i]:>8.1f} "
                         f"{1e3 * rows['ttst_s'][i]:>8.1f} {1e3 * rows['first_to_second_s'][i]:>9.1f} "
                         f"{1e3 * rows['export_s'][i]:>7.1f} {1e3 * rows['deliver_s'][i]:>8.1f} "
                         f"{1e3 * rows['handoff_s'][i]:>9.1f} {rows['handoff_share_of_ttst'][i]:>6.2f} "
                         f"{rows['kv_bytes'][i] / MIB:>7.2f}")
        streamed, whole = share["modes"]["streamed"], share["modes"]["whole"]
        below = [r["first_to_second_s"] < whole["handoff_s"][i] for r in streamed["requests"][i]]
        lines.append(f"{'':>8} streamed 1st->2nd / whole hand-off: "
                     f"{streamed['first_to_second_s'][i] / whole['handoff_s'][i]:.2f} "
                     f"({sum(below)} of {len(below)} streamed requests below it); "
                     f"/ its deliver alone: "
                     f"{streamed['first_to_second_s'][i] / whole['deliver_s'][i]:.2f}")
    return "\n".join(lines)


def copies_per_path() -> dict[str, dict[str, int]]:
    """Copies of the KV bytes per transport path, as each transport's docstring counts."""
    from pdserve.kv_transfer import grpc_bytes, ray_store

    return {"ray": dict(ray_store.COPIES), "grpc": dict(grpc_bytes.COPIES)}


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


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.router.embedded_ray import idle_openmp_passively

    idle_openmp_passively()  # the stand-in ranks idle their copy threads as ranks do
    import ray

    from pdserve.bench.serve import write_json

    sizes = [float(s) for s in args.sizes.replace(",", " ").split()]
    if not sizes or any(s * MIB < BLOCK_BYTES for s in sizes):
        print(f"error: --sizes must be MiB values of at least one block "
              f"({BLOCK_BYTES / MIB:g} MiB)", file=sys.stderr)
        return 2
    transports = [t for t in args.transports.replace(",", " ").split()]
    if not 1 <= args.copy_threads <= 64:
        print(f"error: --copy-threads must be in [1, 64], got {args.copy_threads}", file=sys.stderr)
        return 2
    share_tokens: list[int] = []
    if args.prompt_tokens.strip().lower() not in ("", "none"):
        try:
            share_tokens = [int(t) for t in args.prompt_tokens.replace(",", " ").split()]
        except ValueError:
            share_tokens = [0]
        if any(not 16 <= t <= LONG_CONTEXT - 64 for t in share_tokens) or args.chunk_tokens < 16:
            print(f"error: --prompt-tokens must be token counts in [16, {LONG_CONTEXT - 64}] "
                  "(or 'none'), --chunk-tokens >= 16", file=sys.stderr)
            return 2
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
