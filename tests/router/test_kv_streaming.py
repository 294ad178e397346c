"""KV streamed ahead of the hand-off, through the service: prompts that take several
prefill steps send each step's full blocks to their decode rank while the rest computes;
outputs stay the offline LLM's on both transports, a rank killed mid-stream costs no
tokens, and afterwards nothing is held anywhere."""

from __future__ import annotations

import asyncio
import random

import pytest
import ray

from pdserve.router.client import AsyncClient

MAX_TOKENS = 8
# the prefill ranks take a prompt 64 tokens a step: a 300-token prompt streams 4 chunks
ENGINE = dict(num_kv_blocks=256, max_num_batched_tokens=64)


def long_prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 4000) for _ in range(250 + 7 * i)] for i in range(num)]


async def _generate_all(router, prompts, delay_s=0.0):
    async with AsyncClient(router.address, timeout=120) as client:
        async def one(i):
            await asyncio.sleep(delay_s * i)
            return await client.generate(prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                                         ignore_eos=True)

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))


@pytest.mark.parametrize("transport", ["ray", "grpc"])
def test_long_prompts_stream_their_kv_and_decode_the_offline_tokens(make_router, reference,
                                                                    transport):
    router = make_router(prefill=1, decode=1, kv_transport=transport, engine=ENGINE)
    try:
        prompts = long_prompts(6, seed=11)
        outs = asyncio.run(_generate_all(router, prompts, delay_s=0.05))
        assert [o.token_ids for o in outs] == reference(prompts, MAX_TOKENS)
        assert router.service.num_kv_chunks_streamed >= 3 * len(prompts)
        # ray, one node: prefill ranks had their decode rank import hand-offs directly
        assert (router.service.num_direct_handoffs > 0) == (transport == "ray")
        # ... woken through the decode rank's wake channel (wake_channel.py), and the
        # chunks and any other hand-off asked of it there by the router, not by Ray calls
        asyncio.run(router.service.refresh_stats())
        woken = sum(r.stats.num_woken_imports for r in router.service.pools["decode"].ranks)
        assert (woken > 0) == (transport == "ray")
        # (a wake whose import the decode rank refused, e.g. no room at that instant, is
        # counted as a refused direct hand-off and then delivered by the router)
        assert woken <= router.service.num_direct_handoffs + router.service.num_direct_refused
        assert (router.service.num_direct_local > 0) == (transport == "ray")
        local = getattr(router.service.transport, "num_local_imports", 0)
        assert (local >= router.service.num_kv_chunks_streamed) == (transport == "ray")
        router.assert_nothing_left()
    finally:
        router.close()


# (a prefill rank killed mid-stream: the chaos scenarios, whose long prompts stream)
@pytest.mark.parametrize("pool_name", ["decode"])
def test_a_rank_killed_mid_stream_costs_no_tokens(make_router, reference, pool_name):
    router = make_router(prefill=2, decode=2, collective_timeout_s=3.0, engine=ENGINE)
    try:
        prompts = long_prompts(10, seed=5 if pool_name == "decode" else 6)
        want = reference(prompts, MAX_TOKENS)
        service = router.service

        async def run():
            task = asyncio.ensure_future(_generate_all(router, prompts, delay_s=0.05))
            victim = None
            for _ in range(3000):  # a rank in the middle of a stream of chunks
                streams = [s for s in service.kv_streams.streams.values() if s.delivered and not s.closed]
                if streams:
                    victim = streams[0].dst if pool_name == "decode" else streams[0].src
                    if victim is not None:
                        break
                await asyncio.sleep(0.005)
            assert victim is not None, "no stream of chunks was ever in flight"
            ray.kill(victim.actor, no_restart=True)
            return victim, await task

        victim, outs = asyncio.run(run())
        assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
        assert [o.token_ids for o in outs] == want
        assert victim.state == "dead"
        router.assert_nothing_left()
    finally:
        router.close()


def test_a_direct_hand_off_that_fails_is_delivered_by_the_router(make_router, reference):
    """The prefill rank is sent to a decode rank that holds none of the chunks: its
    direct import is refused (a cache miss), the router delivers the chunks and the
    payload itself, and nothing is left on either decode rank."""
    router = make_router(prefill=1, decode=2, engine=ENGINE)
    service, sent_to = router.service, []
    tell = service.handoffs.tell_direct

    async def tell_the_other_rank(src, attempt, dst):
        if dst is not None:
            dst = next(r for r in service.pools["decode"].ranks if r is not dst)
            service.kv_streams.streams[attempt].direct_dst = dst
        sent_to.append(dst)
        await tell(src, attempt, dst)

    service.handoffs.tell_direct = tell_the_other_rank
    try:
        prompts = long_prompts(3, seed=21)
        outs = asyncio.run(_generate_all(router, prompts, delay_s=0.2))
        assert [o.token_ids for o in outs] == reference(prompts, MAX_TOKENS)
        assert any(d is not None for d in sent_to)
        assert service.num_direct_handoffs == 0 and service.num_direct_refused > 0
        router.assert_nothing_left()
    finally:
        router.close()


def test_decode_reports_ahead_of_their_direct_hand_off_wait_for_it(make_router, reference):
    """The prefill rank's report (first token, hand-off ticket) is held back until its
    direct hand-off's decode rank has reported the next tokens: those wait for the
    ticket and follow it, so nothing is lost, moved or out of order."""
    router = make_router(prefill=1, decode=1, engine=ENGINE)
    service = router.service
    on_step = service.reports.on_step

    def late_hand_offs(pool, rank, step):
        if any(t.direct_import is not None for t in step.handoffs):
            # long enough for the decode rank to report first on a loaded 2-core machine
            asyncio.get_running_loop().call_later(1.0, on_step, pool, rank, step)
            return
        on_step(pool, rank, step)

    service.reports.on_step = late_hand_offs
    try:
        prompts = long_prompts(3, seed=31)
        moves, lost = service.num_moves, service.num_lost_reports
        outs = asyncio.run(_generate_all(router, prompts, delay_s=0.4))
        assert [o.token_ids for o in outs] == reference(prompts, MAX_TOKENS)
        assert service.num_early_reports >= len(prompts)  # every one decoded ahead
        assert (service.num_moves, service.num_lost_reports) == (moves, lost)
        router.assert_nothing_left()
    finally:
        router.close()
