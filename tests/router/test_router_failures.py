"""A rank dies mid-load (ray.kill): its requests are re-prefilled on a surviving or
replacement rank and finish with the same greedy tokens, or end with an error naming
the cause; the router never hangs and keeps serving; the pool re-forms."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from pdserve.router.client import AsyncClient, Client


@pytest.fixture(scope="module")
def router(make_router):
    # room for the several-choices load on one surviving decode rank
    h = make_router(prefill=2, decode=2, collective_timeout_s=3.0,
                    engine=dict(num_kv_blocks=512))
    yield h
    h.close()  # its ranks hold the session's pool resources


def _load_with_kill(router, reference, pool_name: str, n: int = 24, choices: int = 1,
                    max_tokens: int = 40):
    """``choices`` > 1: each request asks for that many greedy choices (one prefill,
    one hand-off); each choice on the dead rank moves on its own, to the same tokens."""
    prompts = [f"{pool_name} failure {i}: the quick brown fox" for i in range(n)]
    want = reference(prompts, max_tokens)
    pool = router.service.pools[pool_name]
    generation = pool.generation

    async def run():
        async with AsyncClient(router.address, timeout=90) as client:
            async def one(i):
                await asyncio.sleep(0.03 * i)
                if choices > 1:
                    return await client.generate_choices(prompts[i], choices,
                                                         max_tokens=max_tokens,
                                                         temperature=0, ignore_eos=True)
                return await client.generate(prompts[i], max_tokens=max_tokens, temperature=0,
                                             ignore_eos=True)

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            await asyncio.sleep(0.5)
            victim = None
            for _ in range(1000):  # a rank with requests on it (prefills are quick)
                victim = next((r for r in pool.ready() if r.inflight), None)
                if victim is not None:
                    break
                await asyncio.sleep(0.01)
            assert victim is not None, f"no {pool_name} rank ever held a request"
            killed_at.append(time.monotonic())
            ray.kill(victim.actor, no_restart=True)
            return victim, await asyncio.gather(*tasks, return_exceptions=True)

    started = time.monotonic()
    killed_at: list[float] = []
    victim, outs = asyncio.run(run())
    elapsed = time.monotonic() - started
    assert elapsed < 90
    errors = []
    outs = [(i, o) for i, out in enumerate(outs) for o in (out if isinstance(out, list) else [out])]
    assert len(outs) == n * choices
    for i, out in outs:
        assert not isinstance(out, BaseException), out  # never a hang or a broken stream
        if out.finish_reason == "error":
            errors.append(out.error)
            assert "died" in out.error, out.error  # the cause is named
        else:
            assert out.finish_reason == "length" and out.token_ids == want[i], i
    # greedy requests are recomputed, not failed
    assert not errors, errors
    assert victim.state == "dead"
    assert pool.generation > generation  # the group re-formed without it
    _wait_for(lambda: len(pool.ready()) == 2, 60.0)  # ... and a replacement joined
    after = [f for f in pool.formations if f.at > killed_at[0]]
    # The survivor formed a group of its own first (it did not wait for the collective
    # timeout, nor for the replacement to load), then the replacement joined it.
    assert after[0].size == 1, after
    assert after[0].at - killed_at[0] < router.service.config.collective_timeout_s, after
    assert after[-1].size == 2, after
    # the service keeps serving, with the same tokens
    with Client(router.address, timeout=60) as client:
        assert client.generate(prompts[0], max_tokens=max_tokens, temperature=0,
                               ignore_eos=True).token_ids == want[0]
    router.assert_nothing_left()


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_kill_a_prefill_rank_mid_load(router, reference):
    _load_with_kill(router, reference, "prefill")


def test_kill_a_decode_rank_mid_load(router, reference):
    _load_with_kill(router, reference, "decode")


@pytest.mark.parametrize("pool_name", ["prefill", "decode"])
def test_kill_a_rank_under_requests_of_several_choices(router, reference, pool_name):
    _load_with_kill(router, reference, pool_name, n=24, choices=3, max_tokens=64)


def test_unseeded_sampled_request_moves_on_with_fresh_randomness(router):
    """A sampled request without a seed on a dead decode rank is recomputed elsewhere
    from its history and continues (fresh randomness), never a token twice or lost."""
    pool = router.service.pools["decode"]
    with Client(router.address, timeout=90) as client:
        stream = client.stream("the quick brown fox", max_tokens=300, temperature=1.0,
                               ignore_eos=True)
        seen = list(next(stream).token_ids) + list(next(stream).token_ids)
        victim = next(r for r in pool.ready() if r.inflight)
        moves = router.service.num_moves
        ray.kill(victim.actor, no_restart=True)
        rest = list(stream)
    last = rest[-1]
    assert last.finish_reason == "length", last.error
    tokens = seen + [t for m in rest for t in m.token_ids]
    assert len(tokens) == 300  # every token exactly once
    assert last.usage.completion_tokens == 300
    assert router.service.num_moves > moves
    assert last.timings.moves == 1  # the client is told its request was moved once
