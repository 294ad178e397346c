"""A hung rank (SIGSTOP: alive, silent) is not a dead one: nothing tells its peers, so
the collective timeout is the backstop. Its survivor's vote times out, the pool re-forms
without it (it is declared dead once it answers nothing), the requests it held move,
and every request still ends with its offline greedy tokens."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pdserve.router.client import AsyncClient

COLLECTIVE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def router(make_router):
    h = make_router(prefill=2, decode=1, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                    group_timeout_s=4.0, rank_call_timeout_s=3.0)
    yield h
    h.close()


def test_a_stopped_rank_ends_in_the_timeouts_reform(router, reference):
    pool = router.service.pools["prefill"]
    prompts = [f"hung rank {i}: the quick brown fox" for i in range(8)]
    want = reference(prompts, 16)
    victim = pool.ready()[0]
    stopped_at = time.monotonic()
    os.kill(victim.info.pid, signal.SIGSTOP)
    try:
        async def run():
            async with AsyncClient(router.address, timeout=90) as client:
                async def one(i):
                    await asyncio.sleep(0.2 * i)
                    return await client.generate(prompts[i], max_tokens=16, temperature=0,
                                                 ignore_eos=True)

                return await asyncio.gather(*(one(i) for i in range(len(prompts))),
                                            return_exceptions=True)

        outs = asyncio.run(run())
    finally:
        if victim.state != "dead":
            os.kill(victim.info.pid, signal.SIGCONT)
    for i, out in enumerate(outs):
        assert not isinstance(out, BaseException), (i, out)
        assert out.finish_reason == "length" and out.token_ids == want[i], (i, out.error)
    assert victim.state == "dead", victim.state
    first = next(f for f in pool.formations if f.at > stopped_at)
    # Nothing reported the stopped rank dead: its survivor waited out the vote's timeout.
    assert first.at - stopped_at >= COLLECTIVE_TIMEOUT_S, first
    assert victim not in pool.ranks or victim.state == "dead"
    deadline = time.monotonic() + 60
    while len(pool.ready()) < 2:  # a replacement joins
        assert time.monotonic() < deadline, pool.ranks
        time.sleep(0.1)
    router.assert_nothing_left()
