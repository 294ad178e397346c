"""ScalePool under load: each pool 1 -> 2 -> 1 while 50+ requests stream; none is
lost or changed, and nothing leaks. Also greedy equality with 2 ranks per pool."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.client import AsyncClient, Client


@pytest.fixture(scope="module")
def router(shared_router):
    return shared_router


def _drained(h):
    stats = h.wait_drained()
    for pool, ranks in stats.items():
        for r in ranks:
            assert r["num_free_blocks"] == r["num_total_blocks"], (pool, r)
    assert len(h.service.tracker) == 0
    assert h.drained_errors() == []


def _ranks(h, pool):
    return len(h.service.pools[pool].ready())


def test_scale_each_pool_up_and_down_under_load(router, reference):
    prompts = [f"request {i}: the quick brown fox jumps over" for i in range(56)]
    want = reference(prompts, 24)

    async def run():
        async with AsyncClient(router.address, timeout=240) as client:
            async def one(i):
                await asyncio.sleep(0.04 * i)  # a steady arrival of requests
                return await client.generate(prompts[i], max_tokens=24, temperature=0)

            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            await asyncio.sleep(0.3)
            steps = [("prefill", 2), ("decode", 2), ("prefill", 1), ("decode", 1)]
            seen = []
            for pool, n in steps:
                reply = await client.scale(pool, n)
                seen.append((pool, reply.previous_replicas, reply.replicas))
            return seen, await asyncio.gather(*tasks)

    seen, outs = asyncio.run(run())
    assert seen == [("prefill", 1, 2), ("decode", 1, 2), ("prefill", 2, 1), ("decode", 2, 1)]
    for i, out in enumerate(outs):
        assert out.finish_reason in ("length", "stop"), (i, out)
        assert out.token_ids == want[i], i
    assert _ranks(router, "prefill") == 1 and _ranks(router, "decode") == 1
    _drained(router)


def test_two_ranks_per_pool_greedy_equals_offline(router, reference):
    with Client(router.address, timeout=120) as client:
        client.scale("prefill", 2)
        client.scale("decode", 2)
        state = client.cluster_state()
        assert [len(p.ranks) for p in state.pools] == [2, 2]
        prompts = ["def foo(x):", "the quick brown fox", "one two three", "river mountain"]
        outs = [client.generate(p, max_tokens=10, temperature=0) for p in prompts]
        want = reference(prompts, 10)
        assert [o.token_ids for o in outs] == want
        state = client.cluster_state()
    # both ranks of each pool took work (round-robin on ties, least-loaded otherwise)
    for pool in state.pools:
        assert all(r.num_steps > 0 for r in pool.ranks), pool
    _drained(router)
