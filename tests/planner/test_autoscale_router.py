"""The planner on a real router (embedded Ray, the tiny model): with autoscale on and a
TTFT objective no request can meet, load grows the prefill pool; once the load stops,
the pool goes back to its minimum; no request fails; every decision shows in
GetClusterState, `pdserve status` and the metrics. Short intervals keep it quick."""

from __future__ import annotations

import asyncio
import time

from pdserve.cli import main as pdserve_main
from pdserve.router.client import AsyncClient, Client

PROMPTS = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(8)]


def _config(model_dir: str):
    from pdserve.router.config import PoolConfig, RouterConfig

    engine = dict(num_kv_blocks=128, max_num_seqs=16, block_size=16)
    return RouterConfig(
        model_dir=model_dir, port=0, http_port=0, metrics_port=0,
        prefill=PoolConfig("prefill", replicas=1, num_cpus=0.5, resources={"prefill": 1},
                           engine=engine),
        decode=PoolConfig("decode", replicas=1, num_cpus=0.5, resources={"decode": 1},
                          engine=engine),
        autoscale=True, slo_ttft_ms=1.0, slo_itl_ms=60_000.0,  # TTFT always breaks
        min_prefill=1, max_prefill=2, min_decode=1, max_decode=1,
        planner_interval_s=0.25, planner_cooldown_s=2.0, planner_warmup_s=0.0,
        planner_window_s=5.0, planner_min_samples=3, drain_timeout_s=5.0,
        collective_timeout_s=10.0)


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.1)


def test_load_grows_prefill_and_idle_returns_it_to_the_minimum(ray_session, tiny_model_dir,
                                                               capsys):
    from pdserve.bench.harness import RouterHarness

    h = RouterHarness(_config(tiny_model_dir))
    try:
        prefill = h.service.pools["prefill"]

        def grown() -> bool:
            return len(prefill.ready()) == 2 and (prefill.scaling is None
                                                  or prefill.scaling.done())

        async def load() -> list:
            """Four clients back to back until the pool has grown (at most 60 s)."""
            outs = []
            deadline = time.monotonic() + 60
            async with AsyncClient(h.address, timeout=60) as client:
                async def one_client(k: int) -> None:
                    i = k
                    while not grown() and time.monotonic() < deadline:
                        outs.append(await client.generate(PROMPTS[i % len(PROMPTS)],
                                                          max_tokens=6, temperature=0))
                        i += 4
                await asyncio.gather(*(one_client(k) for k in range(4)))
            return outs

        outs = asyncio.run(load())
        with Client(h.address, timeout=30) as client:
            right_after = client.cluster_state().planner
        assert right_after.ttft_p90_ms > 1.0  # the recent window the planner judged
        assert grown(), ([(r.name, r.state) for r in prefill.ranks], len(outs),
                         repr(h.service.planner_state()))
        assert all(o.finish_reason in ("length", "stop") for o in outs), \
            [o.error for o in outs if o.finish_reason not in ("length", "stop")]
        _wait(lambda: len(prefill.ready()) == 1 and prefill.target == 1
              and (prefill.scaling is None or prefill.scaling.done()), 40, "back to 1 rank")

        with Client(h.address, timeout=30) as client:
            planner = client.cluster_state().planner
        assert planner.enabled and planner.slo_ttft_ms == 1.0 and planner.max_prefill == 2
        moves = [(d.pool, d.from_replicas, d.to_replicas, d.outcome) for d in planner.decisions]
        assert moves == [("prefill", 1, 2, "applied"), ("prefill", 2, 1, "applied")], moves
        assert planner.decisions[0].reason.startswith("TTFT p90 ")
        assert planner.decisions[1].reason.startswith("idle for ")

        assert pdserve_main(["status", "--address", h.address]) == 0
        out = capsys.readouterr().out
        assert "planner: on, objectives TTFT 1 ms and ITL 60000 ms at p90" in out
        assert "prefill 2 -> 1 [applied]: idle for" in out

        metrics = h.service.metrics.registry
        for direction in ("up", "down"):
            assert metrics.get_sample_value("pdserve_planner_decisions_total", {
                "pool": "prefill", "direction": direction, "outcome": "applied"}) == 1
        h.assert_nothing_left()
    finally:
        h.close()
