"""The ``device`` transport's CUDA IPC path (kv_transfer/device/cuda_ipc.py): a decode
rank on the prefill rank's node maps the payload's device memory and copies it into its
blocks, and a pair the driver refuses falls back to a pair group.

On CPU: which pairs map, the handle's bounds, the real driver code refusing what it
cannot share, and the router's whole flow between two real endpoints (in one process,
their calls on threads as a rank runs them) with an IPC test double that shares host
tensors: the lease rules (held until released, cut copies too, nothing mapped after
any outcome), refusal falling back to a real gloo pair group, a destination that died
or never answers. The ``gpu`` tests map real device memory between two processes and
serve 1P+1D on one GPU through Ray (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import os
import pickle
import secrets
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.kv.payload import KVPayload
from pdserve.engine.rank_pool import DeadRank, RankPool
from pdserve.kv_transfer.base import DeliveryResult, node_id
from pdserve.kv_transfer.device import cuda_ipc
from pdserve.kv_transfer.device.calls import MapPayload, SharePayload
from pdserve.kv_transfer.device.cuda_ipc import HANDLE_BYTES, IpcHandle, IpcRefused
from pdserve.kv_transfer.device.endpoint import DeviceEndpoint, maps
from pdserve.kv_transfer.device.transport import DeviceTransport
from pdserve.rank.messages import HandoffTicket

CUDA = torch.cuda.is_available()


def make_payload(seed: int = 0, num_blocks: int = 5) -> KVPayload:
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, 4, 2, 8)  # [layers, blocks, block_size, heads, dim]
    return KVPayload(
        attempt=f"r{seed}", model_fingerprint="fp", dtype="float32", block_size=4,
        num_layers=2, token_ids=[1 + (i * 7 + seed) % 50 for i in range(18)] + [3],
        num_prompt_tokens=18, sampling={"temperature": 0.0},
        tensors={"k_blocks": torch.randn(shape, generator=g),
                 "v_blocks": torch.randn(shape, generator=g)})


def export(endpoint: DeviceEndpoint, payload: KVPayload) -> int:
    """As the engine exports: into a tensor the endpoint lends; its size."""
    layout = payload.layout({n: (t.dtype, tuple(t.shape)) for n, t in payload.tensors.items()})
    buffer = endpoint.payload_buffer(payload.attempt, layout.nbytes)
    for name, view in layout.write(buffer).items():
        view.copy_(payload.tensors[name].to(buffer.device))
    endpoint.export(payload.attempt, buffer)
    return layout.nbytes


def same(a: KVPayload, b: KVPayload) -> None:
    assert (a.attempt, a.token_ids, a.skipped_blocks) == (b.attempt, b.token_ids, b.skipped_blocks)
    for name in a.tensors:
        assert torch.equal(a.tensors[name].cpu(), b.tensors[name].cpu()), name


# -- which pairs map, and what a receiver maps --------------------------------------


def test_only_two_cuda_ranks_on_one_node_map():
    def info(device, node="n1"):
        return SimpleNamespace(device=device, node_id=node, gpu_uuid="GPU-1")

    assert maps(info("cuda:0"), info("cuda:0"))
    assert maps(info("cuda:0"), info("cuda:1"))  # another GPU: the driver decides
    assert not maps(info("cuda:0"), info("cuda:0", node="n2"))  # across nodes: NCCL
    assert not maps(info("cuda:0"), info("cpu"))
    assert not maps(info("cpu"), info("cpu"))
    assert not maps(None, None)


def handle(**changes) -> IpcHandle:
    fields = dict(node_id="n1", gpu_uuid="GPU-1", handle=bytes(range(HANDLE_BYTES)),
                  offset=512, nbytes=1000, span=4096)
    return IpcHandle(**{**fields, **changes})


def test_a_receiver_maps_nothing_out_of_bounds_or_from_elsewhere():
    handle().check("n1", "GPU-1", 1000)  # in bounds
    handle().check("n1", "GPU-2", 1000)  # another GPU of the node: the driver's to say
    for bad, why in [(handle(handle=b"x" * 63), "64 bytes"),
                     (handle(offset=-1), "at -1"),
                     (handle(offset=3500), "at 3500 of 4096"),
                     (handle(nbytes=0), "0 bytes"),
                     (handle(nbytes=1001), "at most 1000")]:
        with pytest.raises(ValueError, match=why):
            bad.check("n1", "GPU-1", 1000)
    with pytest.raises(IpcRefused, match="another node"):
        handle().check("n2", "GPU-1", 1000)
    with pytest.raises(IpcRefused, match="not on CUDA"):
        handle().check("n1", "", 1000)
    shown = repr(handle()) + str(handle())
    assert "GPU-1" in shown and bytes(range(HANDLE_BYTES)).hex()[:16] not in shown
    assert "\\x00\\x01" not in shown


@pytest.mark.skipif(CUDA, reason="checks the refusals without a GPU")
def test_without_a_gpu_a_rank_refuses_to_share_and_says_why():
    with pytest.raises(IpcRefused, match="CUDA tensor"):
        cuda_ipc.share(torch.zeros(8, dtype=torch.uint8), "n1", "GPU-1")
    endpoint = DeviceEndpoint("cpu", importer=Importer())
    export(endpoint, make_payload(1))
    shared = endpoint.handle(SharePayload("r1", 0))
    assert isinstance(shared, DeliveryResult) and shared.kind == "unreachable"
    mapped = endpoint.handle(MapPayload(handle(node_id=node_id()), 1000, 0))
    assert not mapped.ok and mapped.kind == "unreachable" and "not on CUDA" in mapped.error
    bad = endpoint.handle(MapPayload("not a handle", 1000, 0))
    assert not bad.ok and bad.kind == "transport" and "not an IPC handle" in bad.error
    assert endpoint.importer.got == []


# -- the router's flow on CPU, with an IPC double that shares host tensors -------------


class HostIpc:
    """Stands in for ``cuda_ipc`` on CPU: ``share`` registers the tensor under a random
    handle, ``Mapper.mapped`` yields it; counts what is open, refuses when told."""

    def __init__(self) -> None:
        self.shared: dict[bytes, torch.Tensor] = {}
        self.refuse = False
        ipc = self

        class Mapper:
            def __init__(self) -> None:
                self.open = 0

            @contextmanager
            def mapped(self, h: IpcHandle, device):
                if ipc.refuse:
                    raise IpcRefused("cuIpcOpenMemHandle failed: CUDA error 201")
                self.open += 1
                try:
                    yield ipc.shared[h.handle][h.offset:h.offset + h.nbytes]
                finally:
                    self.open -= 1

            def num_open(self) -> int:
                return self.open

        self.Mapper = Mapper

    def gpu_uuid(self, device) -> str:
        return "GPU-host"

    def share(self, tensor, node_id, gpu_uuid) -> IpcHandle:
        key = secrets.token_bytes(HANDLE_BYTES)
        self.shared[key] = tensor
        return IpcHandle(node_id, gpu_uuid, key, 0, tensor.numel(), tensor.numel())


class Importer:
    """A decode rank's import: the payload read from the mapped bytes and kept (copied,
    as the engine copies into its blocks); ``answer``: refuse with that kind."""

    def __init__(self, answer: str = "") -> None:
        self.got: list[KVPayload] = []
        self.borrowed: list[bool] = []
        self.answer = answer

    def import_prefilled(self, data, *, borrowed=False, skip_blocks=0):
        self.borrowed.append(borrowed)  # mapped bytes are the sender's
        if self.answer:
            return DeliveryResult(False, kind=self.answer, error=f"refused: {self.answer}")
        payload = KVPayload.from_tensor(data, vocab_size=100)
        payload.tensors = {n: t.clone() for n, t in payload.tensors.items()}
        self.got.append(payload)
        return DeliveryResult(True, attempt=payload.attempt, nbytes=data.numel())

    def abort(self, attempt):
        return False


class Actor:
    """A rank's ``kv_call`` as the router awaits it: the endpoint answers on a thread;
    ``dead``: the call fails as a dead actor's; ``hang``: it never answers."""

    def __init__(self, endpoint: DeviceEndpoint) -> None:
        self.endpoint, self.dead, self.hang = endpoint, False, False
        self.kv_call = SimpleNamespace(remote=self._call)
        self.release_kv = SimpleNamespace(remote=self._release)

    async def _release(self, attempt):
        if self.dead:
            raise RuntimeError("ActorDiedError: the actor died unexpectedly")
        self.endpoint.release(attempt)

    async def _call(self, call):
        if self.dead:
            raise RuntimeError("ActorDiedError: the actor died unexpectedly")
        if self.hang:
            await asyncio.sleep(3600)
        return await asyncio.to_thread(self.endpoint.handle, call)


def ranks(ipc: HostIpc, importer: Importer | None = None):
    info = SimpleNamespace(device="cuda:0", node_id="", gpu_uuid="GPU-host")
    src_end = DeviceEndpoint("cpu", "127.0.0.1", ipc=ipc)
    dst_end = DeviceEndpoint("cpu", "127.0.0.1", ipc=ipc, importer=importer or Importer())
    src = SimpleNamespace(uid=1, info=info, actor=Actor(src_end))
    dst = SimpleNamespace(uid=2, info=info, actor=Actor(dst_end))
    return src, dst


def deliver(transport, src, payload: KVPayload, dst, skip=0) -> DeliveryResult:
    nbytes = export(src.actor.endpoint, payload)
    ticket = HandoffTicket(payload.attempt, 5, 3, nbytes, payload.attempt, None)
    return asyncio.run(transport.deliver(ticket, src, dst, skip))


def test_a_mapped_payload_is_imported_and_held_until_released():
    ipc = HostIpc()
    src, dst = ranks(ipc)
    transport = DeviceTransport(timeout_s=20.0)
    for seed, skip in ((1, 0), (2, 2)):
        payload = make_payload(seed)
        result = deliver(transport, src, payload, dst, skip)
        assert result.ok and result.attempt == payload.attempt, result
        got = dst.actor.endpoint.importer.got[-1]
        same(got, payload.without_prefix(skip) if skip else payload)
        if skip:  # cut at the source, which shared the cut copy
            assert result.nbytes < len(payload.to_bytes())
        assert dst.actor.endpoint.mapper.num_open() == 0  # unmapped once imported
    assert dst.actor.endpoint.importer.borrowed == [True, True]  # the bytes are the sender's
    held = src.actor.endpoint
    assert len(held) == 3  # two payloads and the cut copy, until released
    asyncio.run(transport.release(HandoffTicket("r1", 5, 3, 0, "r1", None), src))
    asyncio.run(transport.release(HandoffTicket("r2", 5, 3, 0, "r2", None), src))
    assert len(held) == 0
    assert transport.num_mapped == 2 and transport.num_pairs_formed == 0
    assert transport.delivery_paths() == {"cuda_ipc": 2, "pair_group": 0}  # the metric's
    assert transport.bytes_moved == sum(len(p.to_bytes()) for p in dst.actor.endpoint.importer.got)


def test_an_import_refused_or_a_destination_dead_or_silent_maps_nothing_and_keeps_the_payload():
    ipc = HostIpc()
    transport = DeviceTransport(timeout_s=1.0)
    for answer in ("capacity", "payload", "cache_miss"):
        src, dst = ranks(ipc, Importer(answer))
        result = deliver(transport, src, make_payload(3), dst)
        assert not result.ok and result.kind == answer and "refused" in result.error
        assert dst.actor.endpoint.mapper.num_open() == 0
        assert len(src.actor.endpoint) == 1  # the router decides: retry or discard
    src, dst = ranks(ipc)
    dst.actor.dead = True
    result = deliver(transport, src, make_payload(4), dst)
    assert not result.ok and result.kind == "transport" and "ActorDiedError" in result.error
    dst.actor.dead, dst.actor.hang = False, True
    start = time.monotonic()
    result = deliver(transport, src, make_payload(5), dst)
    assert time.monotonic() - start < 10  # timeout_s + its margin
    assert not result.ok and result.kind == "transport" and "no answer" in result.error
    for attempt in ("r4", "r5"):
        asyncio.run(transport.discard(HandoffTicket(attempt, 5, 3, 0, attempt, None), src))
    assert len(src.actor.endpoint) == 0
    # the source no longer holds it (released, expired): the destination is not asked
    dst.actor.hang = False
    ticket = HandoffTicket("r9", 5, 3, 100, "r9", None)
    result = asyncio.run(transport.deliver(ticket, src, dst))
    assert not result.ok and result.kind == "transport" and "no KV payload" in result.error
    assert transport.num_mapped == 0 and transport.num_pairs_formed == 0


def test_a_pair_the_driver_refuses_goes_through_a_pair_group_from_then_on():
    ipc = HostIpc()
    ipc.refuse = True
    src, dst = ranks(ipc)
    transport = DeviceTransport(timeout_s=20.0)
    payloads = [make_payload(6), make_payload(7)]
    for payload in payloads:
        result = deliver(transport, src, payload, dst)
        assert result.ok, result
    assert transport.num_map_refusals == 1  # asked once for the pair
    assert transport.num_pairs_formed == 1 and transport.num_mapped == 0
    assert transport.delivery_paths() == {"cuda_ipc": 0, "pair_group": 2}
    for got, want in zip(dst.actor.endpoint.importer.got, payloads, strict=True):
        same(got, want)
    for end in (src.actor.endpoint, dst.actor.endpoint):
        end.close()


# -- on CUDA: two processes, one GPU (skipped without one) -----------------------------


def _ipc_rank(ctx, die_in_import: bool) -> dict:
    """Rank 0 shares payloads from its GPU memory; rank 1 maps and imports them."""
    endpoint = DeviceEndpoint("cuda:0", importer=Importer())
    if ctx.rank == 0:
        base = torch.cuda.memory_allocated()
        handles = []
        for seed, skip in ((1, 0), (2, 2)):
            export(endpoint, make_payload(seed))
            handles.append(endpoint.handle(SharePayload(f"r{seed}", skip)))
        assert all(isinstance(h, IpcHandle) for h in handles), handles
        ctx.store.set("handles", pickle.dumps(handles))
        deadline = time.monotonic() + 60
        while not any(ctx.store.check([k]) for k in ("done", "dying")):
            assert time.monotonic() < deadline, "the receiver never answered"
            time.sleep(0.05)
        time.sleep(1.0 if die_in_import else 0)  # a dead receiver's mappings go with it
        for seed in (1, 2):
            endpoint.release(f"r{seed}")
        torch.cuda.synchronize()
        return {"held": len(endpoint), "extra_bytes": torch.cuda.memory_allocated() - base}
    handles = pickle.loads(ctx.store.get("handles"))
    results = []
    for (seed, skip), h in zip(((1, 0), (2, 2)), handles, strict=True):
        if die_in_import:  # dies with the sender's memory mapped
            def die(*args, **kwargs):
                ctx.store.set("dying", "1")
                os._exit(3)

            endpoint.importer.import_prefilled = die
        results.append(endpoint.handle(MapPayload(h, h.nbytes, skip)))
        want = make_payload(seed)
        same(endpoint.importer.got[-1], want.without_prefix(skip) if skip else want)
    ctx.store.set("done", "1")
    return {"ok": [r.ok for r in results], "open": endpoint.mapper.num_open()}


def _run_ipc(die_in_import: bool):
    with RankPool(2) as pool:
        return pool.run(_ipc_rank, die_in_import, timeout=120, allow_dead=die_in_import)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_a_payload_is_mapped_between_two_processes_and_freed_once_released():
    src, dst = _run_ipc(False)
    assert dst == {"ok": [True, True], "open": 0}
    assert src == {"held": 0, "extra_bytes": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_a_receiver_that_dies_mapped_leaks_nothing_in_the_sender():
    src, dst = _run_ipc(True)
    assert isinstance(dst, DeadRank)
    assert src == {"held": 0, "extra_bytes": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_a_decode_rank_killed_during_mapped_hand_offs_costs_no_tokens(
        ray_session, tiny_model_dir, kill_decode_under_load):
    """1P+2D on one GPU: every hand-off mapped; a decode rank killed while they run."""
    from pdserve.bench.harness import RouterHarness
    from pdserve.router.config import PoolConfig, RouterConfig

    engine = dict(num_kv_blocks=256, max_num_seqs=32, block_size=16, max_num_batched_tokens=64)
    config = RouterConfig(
        model_dir=tiny_model_dir, port=0, collective_timeout_s=5.0, kv_transport="device",
        prefill=PoolConfig("prefill", replicas=1, num_cpus=0.5, num_gpus=0.3,
                           resources={"prefill": 1}, engine=engine),
        decode=PoolConfig("decode", replicas=2, num_cpus=0.5, num_gpus=0.3,
                          resources={"decode": 1}, engine=engine))
    router = RouterHarness(config)
    try:
        _, prompts, _ = kill_decode_under_load(router, "ipc kill")
        transport = router.service.transport
        assert transport.num_mapped >= len(prompts) and transport.num_pairs_formed == 0
        router.assert_nothing_left()  # the prefill rank holds no payload or cut copy
    finally:
        router.close()
