"""SIGKILL under load, as a user saw it fail: 2 prefill + 2 decode ranks, 40 greedy
requests in flight, a decode rank killed and, two seconds later, a prefill rank. On
both transports every request ends with its offline greedy tokens (none hangs, none
ends with an error), and the pools come back whole with nothing leaked."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from pdserve.bench import chaos
from pdserve.router.client import AsyncClient


def test_a_decode_kill_then_a_prefill_kill_under_load(chaos_router, reference):
    h = chaos_router
    n = 40
    prompts = [chaos.PROMPTS[i % len(chaos.PROMPTS)] for i in range(n)]

    async def kill(pool: str, at_s: float, victims: list) -> None:
        await asyncio.sleep(at_s)
        ranks = [r for r in h.service.pools[pool].ready() if r.inflight] \
            or h.service.pools[pool].ready()
        victims.append(ranks[0])
        os.kill(ranks[0].info.pid, signal.SIGKILL)

    async def run():
        victims: list = []
        async with AsyncClient(h.address, timeout=120) as client:
            async def one(i):
                await asyncio.sleep(0.02 * i)
                return await client.generate(prompts[i], max_tokens=chaos.MAX_TOKENS,
                                             temperature=0, ignore_eos=True)

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            killers = [asyncio.create_task(kill("decode", 0.5, victims)),
                       asyncio.create_task(kill("prefill", 2.5, victims))]
            outs = await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*killers)
            return outs, victims

    started = time.monotonic()
    outs, victims = asyncio.run(run())
    assert time.monotonic() - started < 120
    for i, out in enumerate(outs):
        assert not isinstance(out, BaseException), (i, out)
        assert out.finish_reason == "length", (i, out.finish_reason, out.error)
        assert out.token_ids == reference.tokens(prompts[i]), i
    result = chaos.ScenarioResult(-1, h.transport, "kill_decode+kill_prefill", n, 0.0)
    chaos.restore_and_check(h, h.sizes, result, 90.0, victims)
    assert result.ok, result.problems
