"""The ``device`` KV transport (kv_transfer/device/): a torch.distributed pair group
per (prefill rank, decode rank), NCCL between GPUs, gloo elsewhere (its CUDA IPC path
between ranks on one node: test_kv_device_ipc.py).

On CPU everything runs with gloo through real processes: the payload read from and
written into uint8 tensors, a pair group's send/recv between two rank processes, and a
router whose ranks are real Ray actors (outputs equal the offline LLM's, streamed chunks
and a cut prefix go the same way, a decode rank killed mid-load costs no tokens, nothing
is left held). The ``gpu`` tests do the same on CUDA (skipped without one)."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time

import pytest
import ray
import torch

from pdserve.engine.kv.payload import KVPayload, KVPayloadError
from pdserve.engine.rank_pool import DeadRank, RankPool
from pdserve.kv_transfer.device.calls import DropPair, JoinPair, OpenPair
from pdserve.kv_transfer.device.endpoint import DeviceEndpoint, pair_backend, tensor_without_prefix
from pdserve.router.client import AsyncClient, Client

MAX_TOKENS = 8
CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


# -- payloads in tensors -------------------------------------------------------------


def make_payload(seed: int = 0, num_layers: int = 2, num_blocks: int = 5) -> KVPayload:
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_blocks, 4, 2, 8)  # [layers, blocks, block_size, heads, dim]
    return KVPayload(
        attempt=f"r{seed}", model_fingerprint="fp", dtype="float32", block_size=4,
        num_layers=num_layers, token_ids=[1 + (i * 7 + seed) % 50 for i in range(18)] + [3],
        num_prompt_tokens=18, sampling={"temperature": 0.0},
        tensors={"k_blocks": torch.randn(shape, generator=g),
                 "v_blocks": torch.randn(shape, generator=g)})


def into_tensor(payload: KVPayload, device: str = "cpu") -> torch.Tensor:
    """As the engine exports: lay out, lend a tensor buffer, fill its tensor views."""
    layout = payload.layout({n: (t.dtype, tuple(t.shape)) for n, t in payload.tensors.items()})
    buffer = DeviceEndpoint(device).payload_buffer(payload.attempt, layout.nbytes)
    for name, view in layout.write(buffer).items():
        assert view.device == buffer.device
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        view.copy_(payload.tensors[name].to(buffer.device))
    return buffer


def _same(a: KVPayload, b: KVPayload) -> None:
    assert (a.attempt, a.token_ids, a.num_prompt_tokens, a.sampling, a.skipped_blocks) == \
        (b.attempt, b.token_ids, b.num_prompt_tokens, b.sampling, b.skipped_blocks)
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert torch.equal(a.tensors[name].cpu(), b.tensors[name].cpu()), name


def _round_trip(device: str) -> None:
    payload = make_payload(1)
    buffer = into_tensor(payload, device)
    assert buffer.dtype == torch.uint8 and buffer.device.type == torch.device(device).type
    # the same bytes as the bytes form, byte for byte
    assert bytes(buffer.cpu().numpy()) == payload.to_bytes()
    back = KVPayload.from_tensor(buffer, vocab_size=100)
    _same(back, payload)
    for t in back.tensors.values():  # views of the tensor, on its device
        assert t.device == buffer.device
        assert buffer.data_ptr() <= t.data_ptr() < buffer.data_ptr() + buffer.numel()
    # the cut: a new tensor on the same device, the prefix gone
    cut = tensor_without_prefix(buffer, 2)
    assert cut.device == buffer.device and cut.numel() < buffer.numel()
    _same(KVPayload.from_tensor(cut), payload.without_prefix(2))


def test_a_payload_round_trips_through_a_tensor_buffer():
    _round_trip("cpu")


def test_a_tensor_payload_gets_the_same_checks_as_bytes():
    payload = make_payload(2)
    buffer = into_tensor(payload)
    data = payload.to_bytes()
    for bad in (buffer[:-1], buffer[:5], torch.cat([buffer, buffer[:1]])):
        with pytest.raises(KVPayloadError) as from_tensor:
            KVPayload.from_tensor(bad.clone())
        with pytest.raises(KVPayloadError) as from_bytes:
            KVPayload.from_bytes(bytes(bad.numpy()))
        assert str(from_tensor.value) == str(from_bytes.value)
    corrupt = buffer.clone()
    corrupt[0] = ord("X")  # bad magic
    with pytest.raises(KVPayloadError, match="magic"):
        KVPayload.from_tensor(corrupt)
    with pytest.raises(KVPayloadError, match=r"token_ids\[1\].*\[0, 10\), got 10"):
        KVPayload.from_tensor(buffer, vocab_size=10)
    with pytest.raises(KVPayloadError, match="uint8"):
        KVPayload.from_tensor(buffer.view(torch.int16) if buffer.numel() % 2 == 0
                              else buffer.float())
    with pytest.raises(ValueError, match="cannot be written"):
        payload.layout({n: (t.dtype, tuple(t.shape)) for n, t in payload.tensors.items()}).write(
            torch.empty(len(data) + 1, dtype=torch.uint8))
    # a bytes-like buffer still works as before
    assert KVPayload.from_bytes(bytearray(data)).attempt == payload.attempt


def test_pair_backend_is_nccl_only_between_two_gpus():
    class Info:
        def __init__(self, device, uuid=""):
            self.device, self.gpu_uuid = device, uuid

    assert pair_backend(Info("cpu"), Info("cpu")) == "gloo"
    assert pair_backend(Info("cuda:0", "a"), Info("cpu")) == "gloo"
    assert pair_backend(Info("cuda:0", "a"), Info("cuda:0", "b")) == "nccl"
    assert pair_backend(Info("cuda:0", "a"), Info("cuda:0", "a")) == "gloo"  # one GPU
    assert pair_backend(None, None) == "gloo"


# -- a pair group between two real processes -----------------------------------------


def _pair_rank(ctx, nonce: str, device: str, backend: str, die_before: str = "") -> dict:
    """Rank 0 is the source, rank 1 the destination, each in its own process."""
    if device == "cuda":
        device = f"cuda:{ctx.rank % torch.cuda.device_count()}"
    endpoint = DeviceEndpoint(device, "127.0.0.1")
    if ctx.rank == 0:
        address = endpoint.open_pair("p1-d1-1", 10.0)
        ctx.store.set("address", address)
    else:
        address = ctx.store.get("address").decode()
    endpoint.join_pair("p1-d1-1", address, ctx.rank, nonce, backend, 10.0)
    out: dict = {"pairs": endpoint.pairs()}
    if ctx.rank == 1:
        ctx.store.set("joined", "1")
    if die_before == ("send" if ctx.rank == 0 else "receive"):
        if ctx.rank == 0:  # once the pair is whole on both sides (its store dies with it)
            ctx.store.get("joined")
        os._exit(3)
    if ctx.rank == 0:
        return _send_payloads(endpoint, device, out)
    return _receive_payloads(endpoint, out)


def _send_payloads(endpoint: DeviceEndpoint, device: str, out: dict) -> dict:
    for seed, skip in ((1, 0), (2, 2), (3, 0)):
        payload = make_payload(seed)
        endpoint.export(f"a{seed}", into_tensor(payload, device))
        out[f"sent{seed}"] = endpoint.send("p1-d1-1", f"a{seed}", skip, 20.0)
    try:  # a payload it no longer holds: the receiver hears so at once
        endpoint.send("p1-d1-1", "gone", 0, 20.0)
    except RuntimeError as exc:
        out["gone"] = str(exc)
    return out


def _receive_payloads(endpoint: DeviceEndpoint, out: dict) -> dict:
    start = time.monotonic()
    for seed, skip in ((1, 0), (2, 2), (3, 0)):
        want = make_payload(seed)
        nbytes = len(want.to_bytes())
        try:
            data = endpoint.receive("p1-d1-1", nbytes, skip, 20.0)
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["seconds"] = time.monotonic() - start
            out["pairs_after"] = endpoint.pairs()
            return out
        assert data.device == endpoint.device and data.dtype == torch.uint8
        got = KVPayload.from_tensor(data, vocab_size=100)
        _same(got, want.without_prefix(skip) if skip else want)
        out[f"got{seed}"] = data.numel()
    try:
        endpoint.receive("p1-d1-1", 1000, 0, 20.0)
    except RuntimeError as exc:
        out["gone"] = str(exc)
    out["pairs_after"] = endpoint.pairs()
    endpoint.close()
    return out


def _run_pair(device: str, backend: str) -> None:
    nonce = secrets.token_hex(16)
    with RankPool(2) as pool:
        src, dst = pool.run(_pair_rank, nonce, device, backend, timeout=90)
    assert src["pairs"] == dst["pairs"] == ["p1-d1-1"]
    assert src["sent1"] == dst["got1"] == len(make_payload(1).to_bytes())
    assert src["sent2"] == dst["got2"] < len(make_payload(2).to_bytes())  # cut at the source
    assert src["sent3"] == dst["got3"]
    assert "no KV payload" in src["gone"] and "no longer holds" in dst["gone"]
    assert dst["pairs_after"] == ["p1-d1-1"]  # a refused payload breaks nothing


def test_a_pair_group_moves_payloads_between_two_processes():
    _run_pair("cpu", "gloo")


def test_a_dead_source_fails_the_receive_in_bounded_time_and_drops_the_pair():
    nonce = secrets.token_hex(16)
    with RankPool(2) as pool:
        src, dst = pool.run(_pair_rank, nonce, "cpu", "gloo", "send", timeout=90,
                            allow_dead=True)
    assert isinstance(src, DeadRank)
    assert "error" in dst and dst["seconds"] < 15, dst
    assert nonce not in dst["error"]
    assert dst["pairs_after"] == []  # dropped: the next delivery forms a new one


def test_a_pair_that_cannot_form_fails_in_bounded_time_without_the_nonce():
    endpoint = DeviceEndpoint("cpu", "127.0.0.1")
    address = endpoint.open_pair("p1-d1-9", 2.0)
    nonce = secrets.token_hex(16)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:  # the destination never joins
        endpoint.join_pair("p1-d1-9", address, 0, nonce, "gloo", 2.0)
    assert time.monotonic() - start < 10
    assert nonce not in str(err.value) and "p1-d1-9" in str(err.value)
    assert endpoint.pairs() == []


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _PairActor:
    """Stands in for a rank's pair-group calls (what the router awaits of them)."""

    def __init__(self, join):
        self.dropped = []

        def call(c):
            if isinstance(c, OpenPair):
                return _answer("tcp://127.0.0.1:1")
            if isinstance(c, JoinPair):
                return join(c)
            assert isinstance(c, DropPair), c
            return self.dropped.append(c.pair)

        self.kv_call = _Method(call)


async def _answer(value):
    return value


def test_a_pair_whose_destination_died_fails_at_once_not_after_the_form_timeout():
    """The destination's join fails at once (its actor died); the source's would wait
    out form_timeout_s for it. The delivery fails at once, and both ranks drop the pair."""
    from types import SimpleNamespace

    from pdserve.kv_transfer.device.transport import DeviceTransport
    from pdserve.rank.messages import HandoffTicket

    async def never(*args):
        await asyncio.sleep(3600)

    async def died(*args):
        raise RuntimeError("ActorDiedError: the actor died unexpectedly")

    src = SimpleNamespace(uid=1, info=None, actor=_PairActor(never))
    dst = SimpleNamespace(uid=2, info=None, actor=_PairActor(died))
    transport = DeviceTransport(timeout_s=60.0, form_timeout_s=30.0)
    ticket = HandoffTicket("a1", 5, 3, 1024, "a1", None)
    start = time.monotonic()
    result = asyncio.run(transport.deliver(ticket, src, dst))
    assert time.monotonic() - start < 5
    assert not result.ok and result.kind == "transport"
    assert "no KV pair group" in result.error and "ActorDiedError" in result.error
    assert len(src.actor.dropped) == 1 and src.actor.dropped == dst.actor.dropped
    assert transport.num_pairs_formed == 0



# -- through the router: real Ray actors, gloo on CPU ----------------------------------


def _generate_all(router, prompts, delay_s=0.02, max_tokens=MAX_TOKENS):
    async def run():
        async with AsyncClient(router.address, timeout=120) as client:
            async def one(i):
                await asyncio.sleep(delay_s * i)
                return await client.generate(prompts[i], max_tokens=max_tokens, temperature=0,
                                             ignore_eos=True)

            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    return asyncio.run(run())


def long_prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 4000) for _ in range(250 + 7 * i)] for i in range(num)]


def shared_prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [1] + [rng.randrange(3, 4000) for _ in range(400)]
    return [system + [rng.randrange(3, 4000) for _ in range(8 + i)] for i in range(num)]


def _check_router(router, reference, expect_backend: str) -> None:
    """``expect_backend``: the pair group's (gloo, nccl), or "ipc": mapped, no group."""
    transport = router.service.transport
    assert transport.name == "device"
    with Client(router.address, timeout=60) as client:
        assert client.cluster_state().kv_transport == "device"
    prompts = [f"device transport {i}: the quick brown fox" for i in range(10)]
    outs = _generate_all(router, prompts)
    assert [o.token_ids for o in outs] == reference(prompts, MAX_TOKENS)
    groups = 0 if expect_backend == "ipc" else 1
    assert transport.num_deliveries >= len(prompts) and transport.num_pairs_formed == groups
    if groups:
        assert {s.backend for s in transport._pairs.values()} == {expect_backend}
    else:
        assert transport.num_mapped == transport.num_deliveries
    # several choices of one prompt share one payload
    with Client(router.address, timeout=60) as client:
        choices = client.generate_choices(prompts[0], 3, max_tokens=MAX_TOKENS, temperature=0,
                                          ignore_eos=True)
    assert [c.token_ids for c in choices] == [reference(prompts[:1], MAX_TOKENS)[0]] * 3
    # long prompts stream their KV ahead in chunks, through the same pair group
    streamed = router.service.num_kv_chunks_streamed
    longs = long_prompts(3, seed=21)
    outs = _generate_all(router, longs, delay_s=0.05)
    assert [o.token_ids for o in outs] == reference(longs, MAX_TOKENS)
    assert router.service.num_kv_chunks_streamed >= streamed + 3 * len(longs)
    # a prefix the decode rank's cache holds is cut at the source: it never crosses (the
    # first prompt streams in chunks, which skip nothing; a later one finds the prefix)
    moved, skipped = [], router.service.num_kv_blocks_skipped
    for prompt in shared_prompts(3, seed=4):
        before = transport.bytes_moved
        assert _generate_all(router, [prompt])[0].token_ids == reference([prompt], MAX_TOKENS)[0]
        moved.append(transport.bytes_moved - before)
    assert router.service.num_kv_blocks_skipped >= skipped + 25  # 400 shared tokens
    assert min(moved[1:]) < 0.2 * moved[0], moved
    assert transport.num_pairs_formed == groups and transport.num_pairs_dropped == 0
    if not groups:
        router.assert_nothing_left()
        return
    # a pair group that broke on one side is dropped on both and formed anew
    (state,) = transport._pairs.values()
    old = state.name
    dst = router.service.pools["decode"].ready()[0]
    assert ray.get(dst.actor.kv_call.remote(DropPair(old)))
    prompt = "after the pair group broke"
    assert _generate_all(router, [prompt])[0].token_ids == reference([prompt], MAX_TOKENS)[0]
    assert transport.num_pairs_dropped == 1 and transport.num_pairs_formed == 2
    assert state.name not in (None, old)
    src = router.service.pools["prefill"].ready()[0]
    assert ray.get(src.actor.kv_call.remote(DropPair(old))) is False  # gone there too
    router.assert_nothing_left()


def test_device_transport_through_the_router_equals_the_offline_llm(make_router, reference):
    router = make_router(prefill=1, decode=1, kv_transport="device",
                         engine=dict(num_kv_blocks=256, max_num_batched_tokens=64))
    try:
        _check_router(router, reference, "gloo")
    finally:
        router.close()


def test_a_decode_rank_killed_mid_load_costs_no_tokens(make_router, kill_decode_under_load):
    router = make_router(prefill=1, decode=2, kv_transport="device", collective_timeout_s=3.0,
                         engine=dict(num_kv_blocks=512))
    try:
        transport = router.service.transport

        def paired(rank):  # a decode rank decoding, its pair group formed
            return rank.uid in {dst for (_, dst), s in transport._pairs.items() if s.name}

        _, prompts, want = kill_decode_under_load(router, "device kill", paired)
        assert transport.num_pairs_formed >= 2  # one per decode rank it delivered to
        # the service keeps serving, through pair groups to the ranks alive
        again = _generate_all(router, prompts[:4], max_tokens=32)
        assert [o.token_ids for o in again] == want[:4]
        router.assert_nothing_left()
    finally:
        router.close()


# -- on CUDA (skipped without one) -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_a_payload_round_trips_through_a_device_tensor():
    _round_trip("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_an_nccl_pair_group_moves_payloads_between_two_gpus():
    _run_pair("cuda", "nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_a_gloo_pair_stages_cuda_payloads_through_the_host():
    _run_pair("cuda", "gloo")  # two ranks on one GPU: what NCCL refuses


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_auto_picks_the_device_transport_and_equals_the_offline_llm(ray_session,
                                                                         tiny_model_dir,
                                                                         reference):
    from pdserve.bench.harness import RouterHarness
    from pdserve.router.config import PoolConfig, RouterConfig

    gpus = 1.0 if torch.cuda.device_count() >= 2 else 0.5  # one GPU: both ranks share it
    engine = dict(num_kv_blocks=256, max_num_seqs=32, block_size=16, max_num_batched_tokens=64)
    config = RouterConfig(
        model_dir=tiny_model_dir, port=0, collective_timeout_s=10.0,
        prefill=PoolConfig("prefill", replicas=1, num_cpus=0.5, num_gpus=gpus,
                           resources={"prefill": 1}, engine=engine),
        decode=PoolConfig("decode", replicas=1, num_cpus=0.5, num_gpus=gpus,
                          resources={"decode": 1}, engine=engine))
    assert config.kv_transport == "auto" and config.resolved_kv_transport() == "device"
    router = RouterHarness(config)
    try:
        infos = [r.info for p in router.service.pools.values() for r in p.ranks]
        assert all(i.device.startswith("cuda") for i in infos), infos
        _check_router(router, reference, "nccl" if gpus == 1.0 else "ipc")
    finally:
        router.close()
