"""The router end to end: real Ray actors, real gRPC on 127.0.0.1, the real tiny model
(one prefill rank, one decode rank, KV through Ray's object store)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pdserve.router.client import AsyncClient, Client, build_request

PROMPTS = [
    "def foo(x):",
    "the quick brown fox",
    "river mountain forest city garden window table paper light music story morning " * 3,
    "one",
]


@pytest.fixture(scope="module")
def router(shared_router):
    return shared_router


def _assert_no_leak(harness, timeout: float = 30.0):
    stats = harness.wait_drained(timeout)
    for pool, ranks in stats.items():
        for r in ranks:
            assert r["num_free_blocks"] == r["num_total_blocks"], (pool, r)
            assert r["num_waiting"] == 0 and r["num_prompted"] == 0, (pool, r)
    assert len(harness.service.tracker) == 0
    assert harness.drained_errors() == []


def test_greedy_output_equals_offline_llm(router, reference):
    want = reference(PROMPTS, 12)
    with Client(router.address, timeout=60) as client:
        outs = [client.generate(p, max_tokens=12, temperature=0) for p in PROMPTS]
    for prompt, out, ref in zip(PROMPTS, outs, want, strict=True):
        assert out.token_ids == ref, prompt
        assert out.finish_reason in ("length", "stop")
        assert out.completion_tokens == len(ref)
        assert out.num_messages <= len(ref)  # batched per step, never more than per token
    # token-id prompts go through the same path
    ids = [1, 327, 399, 81, 10, 90, 320]
    with Client(router.address, timeout=60) as client:
        out = client.generate(ids, max_tokens=6, temperature=0)
    assert out.token_ids == reference([ids], 6)[0]
    _assert_no_leak(router)


def test_text_is_streamed_incrementally(router, reference):
    with Client(router.address, timeout=60) as client:
        msgs = list(client.stream(PROMPTS[0], max_tokens=10, temperature=0))
    assert msgs[0].token_ids and not msgs[0].finish_reason  # first token at once
    assert msgs[-1].finish_reason == "length"
    assert [m.finish_reason for m in msgs[:-1]] == [""] * (len(msgs) - 1)
    text = "".join(m.text for m in msgs)
    from pdserve.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_model(router.service.config.model_dir)
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == reference([PROMPTS[0]], 10)[0]
    assert text == tok.decode(ids)


def test_32_concurrent_streams_all_finish_right(router, reference):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    lens = [4 + (i % 7) * 3 for i in range(32)]
    want = {}
    for n in set(lens):
        group = [p for p, m in zip(prompts, lens, strict=True) if m == n]
        want.update(zip(group, reference(group, n), strict=True))

    async def run():
        async with AsyncClient(router.address, timeout=120) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=n, temperature=0)
                                          for p, n in zip(prompts, lens, strict=True)))

    outs = asyncio.run(run())
    for p, out in zip(prompts, outs, strict=True):
        assert out.finish_reason in ("length", "stop"), out
        assert out.token_ids == want[p], p
    _assert_no_leak(router)


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1, 2, 5000]), "token_ids[2]"),
    (dict(prompt=[1, -3]), "token_ids[1]"),
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", max_tokens=-5), "max_tokens"),
    (dict(prompt="x", max_tokens=10**6), "max_tokens"),
    (dict(prompt="x", temperature=-0.5), "temperature"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", top_k=-2), "top_k"),
    (dict(prompt="x", stop_token_ids=[99999]), "stop_token_ids"),
]


def test_bad_inputs_get_invalid_argument_naming_the_field(router):
    with Client(router.address, timeout=30) as client:
        for kwargs, field in BAD:
            kwargs = dict(kwargs)
            prompt = kwargs.pop("prompt")
            with pytest.raises(grpc.RpcError) as err:
                client.generate(prompt, **kwargs)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
            assert field in err.value.details(), (kwargs, err.value.details())
        too_long = [5] * router.service.limits.max_model_len
        with pytest.raises(grpc.RpcError) as err:
            client.generate(too_long, max_tokens=1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in err.value.details() and "at most" in err.value.details()
        # nothing was harmed: the next request is served normally
        assert client.generate("def foo(x):", max_tokens=3, temperature=0).finish_reason == "length"
    _assert_no_leak(router)


def test_duplicate_id_in_flight_is_already_exists(router):
    with Client(router.address, timeout=60) as client:
        stream = client.stream("the quick brown fox", request_id="dup-1", max_tokens=200,
                               ignore_eos=True, temperature=0)
        first = next(stream)
        assert first.request_id == "dup-1"
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x", request_id="dup-1", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "request_id" in err.value.details()
        assert client.abort("dup-1") is True
        last = list(stream)[-1]
        assert last.finish_reason == "abort"
        # the id is free again once finished
        assert client.generate("x", request_id="dup-1", max_tokens=2).finish_reason
    _assert_no_leak(router)


def test_abort_of_unknown_id_is_harmless(router):
    with Client(router.address, timeout=30) as client:
        assert client.abort("no-such-request") is False
        assert client.abort("") is False
        assert client.generate("one", max_tokens=2).finish_reason == "length"


def test_client_disconnect_mid_stream_frees_blocks_on_both_pools(router):
    with Client(router.address, timeout=60) as client:
        call = client._stub.Generate(
            build_request(PROMPTS[2], max_tokens=2000, ignore_eos=True, temperature=0))
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 5:
                break
        # holds blocks; polled, since a rank busy stepping may miss one stats call's
        # deadline and report its previous poll (seen once under a full suite's load)
        deadline = time.monotonic() + 10.0
        while not any(r["num_free_blocks"] < r["num_total_blocks"]
                      for r in router.stats()["decode"]):
            assert time.monotonic() < deadline, "no decode rank reported the request's blocks"
            time.sleep(0.1)
        call.cancel()
    # 2000 tokens would take far longer than this: the abort freed them
    _assert_no_leak(router, timeout=4.0)


def test_deadline_aborts_the_request(router):
    with Client(router.address) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPTS[1], max_tokens=2000, ignore_eos=True, timeout=0.8)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _assert_no_leak(router, timeout=4.0)


def test_backpressure_past_queue_depth_is_resource_exhausted(router):
    tracker = router.service.tracker
    saved = tracker.max_queue_depth
    tracker.max_queue_depth = 2
    try:
        with Client(router.address, timeout=60) as client:
            streams = [client.stream(PROMPTS[0], request_id=f"bp-{i}", max_tokens=300,
                                     ignore_eos=True) for i in range(2)]
            for s in streams:
                next(s)
            with pytest.raises(grpc.RpcError) as err:
                client.generate("one", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queue_depth" in err.value.details()
            for i, s in enumerate(streams):
                client.abort(f"bp-{i}")
                assert list(s)[-1].finish_reason == "abort"
    finally:
        tracker.max_queue_depth = saved
    _assert_no_leak(router)


def test_cluster_state_health_and_reflection(router):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with Client(router.address, timeout=30) as client:
        state = client.cluster_state()
    assert state.mode == "disaggregated" and state.kv_transport == "ray"
    pools = {p.name: p for p in state.pools}
    assert set(pools) == {"prefill", "decode"}
    for p in pools.values():
        assert p.ranks and all(r.state == "ready" for r in p.ranks)
        assert p.ranks[0].num_total_blocks > 0 and p.ranks[0].node_id

    with grpc.insecure_channel(router.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.rpc.Router"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"pdserve.rpc.Router", "grpc.health.v1.Health"} <= names


def test_sync_client_from_threads(router, reference):
    want = reference(PROMPTS[:2], 5)
    results = {}

    def worker(i):
        with Client(router.address, timeout=60) as client:
            results[i] = client.generate(PROMPTS[i % 2], max_tokens=5, temperature=0).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(results[i] == want[i % 2] for i in range(6))


def test_router_process_imports_no_torch():
    code = ("import sys; import pdserve.router.server, pdserve.router.service, "
            "pdserve.router.client, pdserve.router.cli_commands; "
            "import pdserve.kv_transfer.grpc.transport, pdserve.kv_transfer.ray.transport, pdserve.rank.messages; "
            "import pdserve.prefill_worker, pdserve.decode_worker; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_scale_pool_rejects_bad_arguments(router):
    with Client(router.address, timeout=30) as client:
        for pool, n, field in (("gpu", 1, "pool"), ("decode", 0, "replicas"),
                               ("normal", 1, "pool")):
            with pytest.raises(grpc.RpcError) as err:
                client.scale(pool, n)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()


def test_aborts_at_every_stage_leak_nothing(router):
    """Abort by id after varying delays, so the abort lands while the request is queued,
    prefilling, handing off or decoding; every stream ends with "abort" (or finished
    first) and afterwards every block on both pools is free."""
    long_prompt = list(range(3, 3 + 400))  # several chunks of prefill work

    async def run():
        async with AsyncClient(router.address, timeout=60) as client:
            async def one(i, delay):
                rid = f"race-{i}"
                task = asyncio.create_task(client.generate(
                    long_prompt if i % 2 else PROMPTS[i % 4], request_id=rid, max_tokens=60,
                    ignore_eos=True, temperature=0))
                await asyncio.sleep(delay)
                await client.abort(rid)
                return await task

            # 4 long requests (~29 blocks each at full length) fit the 127-block pools
            delays = [0.0, 0.001, 0.003, 0.01, 0.02, 0.04, 0.08, 0.15]
            return await asyncio.gather(*(one(i, d) for i, d in enumerate(delays)))

    outs = asyncio.run(run())
    assert all(o.finish_reason in ("abort", "length") for o in outs), [
        (o.request_id, o.finish_reason, o.error) for o in outs]
    assert sum(o.finish_reason == "abort" for o in outs) >= 3
    _assert_no_leak(router, timeout=10.0)


def test_client_commands_load_no_torch():
    """`pdserve status` and the other client commands build their own arguments only:
    the benchmarks' (which import torch) are not built for them, so a client starts in a
    fraction of a second."""
    code = ("import sys; from pdserve.cli import main; "
            "rc = main(['status', '--address', '127.0.0.1:1', '--timeout', '0.1']); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert "cannot reach the router" in out.stderr
