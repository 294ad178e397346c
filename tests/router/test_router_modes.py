"""The other paths: NORMAL mode (one pool does both phases) and KV bytes through the
router over gRPC instead of the Ray object store. Same tokens as the offline LLM."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.client import AsyncClient, Client

PROMPTS = ["def foo(x):", "the quick brown fox",
           "river mountain forest city garden window table paper " * 6]


def _run_concurrently(address, prompts, max_tokens):
    async def run():
        async with AsyncClient(address, timeout=120) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=max_tokens, temperature=0)
                                          for p in prompts))

    return asyncio.run(run())


@pytest.mark.parametrize("overrides", [dict(mode="normal"), dict(kv_transport="grpc")],
                         ids=["normal-mode", "grpc-kv-transport"])
def test_greedy_equals_offline(make_router, reference, overrides, request):
    router = make_router(**overrides)
    request.addfinalizer(router.close)  # its ranks hold the session's pool resources
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    outs = _run_concurrently(router.address, prompts, 10)
    assert [o.token_ids for o in outs] == reference(prompts, 10)
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    if overrides.get("kv_transport") == "grpc":
        transport = router.service.transport
        assert transport.num_deliveries >= len(prompts)
        assert transport.bytes_moved > len(prompts) * 1000  # the payloads went through us
    with Client(router.address, timeout=30) as client:
        state = client.cluster_state()
        t = list(client.stream(PROMPTS[0], max_tokens=3, temperature=0))[-1].timings
    # the TTFT breakdown on this path too (normal: no KV moves)
    assert t.prefill_ms > 0
    assert t.router_queue_ms + t.prefill_queue_ms + t.prefill_ms + t.kv_export_ms <= t.ttft_ms
    assert (t.kv_bytes > 0 and t.kv_handoff_ms > 0) == (state.mode == "disaggregated")
    assert state.mode == overrides.get("mode", "disaggregated")
    assert state.kv_transport == overrides.get("kv_transport", "ray")
    stats = router.wait_drained()
    for ranks in stats.values():
        for r in ranks:
            assert r["num_free_blocks"] == r["num_total_blocks"]
    assert router.drained_errors() == []
    router.close()
