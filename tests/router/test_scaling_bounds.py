"""ScalePool is a pool operation with bounds: it completes (or rolls back) whatever its
caller does, a second one while one runs is refused, a size the cluster cannot place
fails in bounded time and leaves the pool as it was, and a scale-down never fails an
in-flight request (what the leaving ranks still hold moves when their drain ends), nor
holds up the re-form after a rank dies meanwhile."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from pdserve.router.client import AsyncClient, Client


def _settled(h, pool: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    p = h.service.pools[pool]
    while time.monotonic() < deadline:
        if (p.scaling is None or p.scaling.done()) and len(p.ready()) == n \
                and not any(r.state == "draining" for r in p.ranks):
            return
        time.sleep(0.1)
    raise AssertionError(f"{pool}: {[(r.name, r.state) for r in p.ranks]}")


DRAIN_S = 4.0


@pytest.fixture(scope="module")
def router(make_router):
    h = make_router(prefill=1, decode=2, drain_timeout_s=DRAIN_S, max_replicas=8)
    yield h
    h.close()  # its ranks hold the session's pool resources


def _greedy_ignore_eos(model_dir: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from pdserve.engine.llm import LLM
    from pdserve.scheduler.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in LLM(model_dir).generate(prompts, sp, use_tqdm=False)]


def test_a_scale_down_whose_caller_leaves_mid_drain_still_completes(router, tiny_model_dir):
    """ScalePool(decode, 1) with a 0.5 s client deadline while long requests decode: the
    call times out, the pool operation goes on, the drain ends after drain_timeout_s and
    the requests left on the leaving rank move and finish with the same tokens."""
    prompts = [f"drain {i}: the quick brown fox" for i in range(6)]
    want = _greedy_ignore_eos(tiny_model_dir, prompts, 160)

    async def run():
        async with AsyncClient(router.address, timeout=120) as client:
            tasks = [asyncio.create_task(client.generate(p, max_tokens=160, temperature=0,
                                                         ignore_eos=True)) for p in prompts]
            await asyncio.sleep(0.8)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.scale("decode", 1, timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # while it runs, another resize of that pool is refused with a clear status
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await client.scale("decode", 2, timeout=5)
            assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "already being resized" in busy.value.details()
            return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    for i, out in enumerate(outs):
        assert out.finish_reason == "length" and out.token_ids == want[i], (i, out.error)
    _settled(router, "decode", 1)
    with Client(router.address, timeout=120) as client:
        assert client.scale("decode", 2).previous_replicas == 1
    _settled(router, "decode", 2)
    router.assert_nothing_left()


def test_a_size_past_the_limit_is_refused_and_scaling_still_works(router):
    with Client(router.address, timeout=120) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.scale("decode", 64)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_replicas" in err.value.details()
        started = time.monotonic()
        assert client.scale("decode", 2).previous_replicas == 2  # nothing wedged
        assert time.monotonic() - started < 5


def test_a_size_the_cluster_cannot_place_fails_in_bounded_time(make_router, reference):
    """The session's Ray has 2 units of `scarce`; each decode rank of this router asks
    for one. Asking for 3 decode ranks leaves one actor pending: the resize fails within
    rank_start_timeout_s, the new ranks are gone, the pool serves at its old size, and
    a size that fits works afterwards."""
    from pdserve.router.config import PoolConfig

    h = make_router(prefill=1, decode=1, rank_start_timeout_s=10.0)
    pool = h.service.pools["decode"]
    # swap the decode pool's resources for the scarce one (a fresh rank per resize)
    pool.config = PoolConfig("decode", replicas=1, num_cpus=0.25, resources={"scarce": 1},
                             engine=pool.config.engine)
    with Client(h.address, timeout=120) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.scale("decode", 4)  # needs 3 more: 2 placeable, 1 pending forever
        took = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed to start" in err.value.details() and "not ready within" in err.value.details()
        assert took < 10.0 + 20.0
        assert len(pool.ready()) == 1 and pool.target == 1
        want = reference(["scarce: hello world"], 8)[0]
        assert client.generate("scarce: hello world", max_tokens=8,
                               temperature=0).token_ids == want
        assert client.scale("decode", 2).previous_replicas == 1  # the scarce units are free
        assert len(pool.ready()) == 2
        assert client.scale("decode", 1).previous_replicas == 2
    h.assert_nothing_left()
    h.close()


def test_a_rank_dying_while_another_drains_is_reformed_away_at_once(router, tiny_model_dir):
    """3 -> 2 decode ranks while long requests decode; a staying rank is SIGKILLed during
    the drain: the survivor and the draining rank re-form at once, not when the drain
    ends; every request still finishes with its tokens, and a replacement joins."""
    pool = router.service.pools["decode"]
    with Client(router.address, timeout=120) as client:
        client.scale("decode", 3)
    _settled(router, "decode", 3)
    prompts = [f"die while draining {i}: the quick brown fox" for i in range(9)]
    want = _greedy_ignore_eos(tiny_model_dir, prompts, 200)

    async def run():
        async with AsyncClient(router.address, timeout=120) as client:
            tasks = [asyncio.create_task(client.generate(p, max_tokens=200, temperature=0,
                                                         ignore_eos=True)) for p in prompts]
            await asyncio.sleep(0.8)
            scaling = asyncio.create_task(client.scale("decode", 2, timeout=120))
            while not any(r.state == "draining" for r in pool.ranks):
                await asyncio.sleep(0.01)
            victim = next(r for r in pool.ranks if r.state == "ready")
            killed_at = time.monotonic()
            os.kill(victim.info.pid, signal.SIGKILL)
            outs = await asyncio.gather(*tasks)
            await scaling
            return killed_at, outs

    killed_at, outs = asyncio.run(run())
    for i, out in enumerate(outs):
        assert out.finish_reason == "length" and out.token_ids == want[i], (i, out.error)
    first = next(f for f in pool.formations if f.at > killed_at)
    assert first.size == 2, list(pool.formations)  # the survivor and the draining rank
    assert first.at - killed_at < DRAIN_S / 2, first.at - killed_at
    _settled(router, "decode", 2)
    router.assert_nothing_left()
