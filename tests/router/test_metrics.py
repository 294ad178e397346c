"""The router's Prometheus endpoint, per-request timings and the step timeline, on the
real router (1 prefill + 1 decode rank, the real tiny model)."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from pdserve.router.client import Client
from pdserve.rpc import router_pb2

PROMPTS = ["def foo(x):", "the quick brown fox", "river mountain forest city garden " * 4,
           "one two three"]
TOL_MS = 25.0  # poll/clock granularity between the client's and the router's clocks


def _scrape(port: int) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _stream(address: str, prompt: str, out: dict, **kw) -> None:
    """Stream one request; note client-side times (ms) of the first two tokens."""
    with Client(address, timeout=60) as client:
        t0 = time.perf_counter()
        token_times = []
        for msg in client.stream(prompt, temperature=0, **kw):
            now = time.perf_counter()
            token_times += [(now - t0) * 1e3] * len(msg.token_ids)
            if "abort_after_first" in out and token_times and not out.get("aborted"):
                out["aborted"] = client.abort(msg.request_id or out["abort_after_first"])
            last = msg
        out.update(times=token_times, e2e_ms=(time.perf_counter() - t0) * 1e3, last=last)


@pytest.fixture(scope="module")
def run(shared_router, reference):
    """A few requests through the router: 3 run to their length, 1 hits a stop token,
    1 is aborted after its first token; scrapes before and after."""
    router = shared_router
    port = router.server.metrics_port
    assert port, "the router serves metrics by default"
    before = _scrape(port)
    since = time.time()
    stop_after = reference([PROMPTS[1]], 4)[0]
    jobs = [dict(prompt=p, kw=dict(max_tokens=6)) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3])]
    jobs.append(dict(prompt=PROMPTS[1], kw=dict(max_tokens=12, stop_token_ids=[stop_after[3]])))
    jobs.append(dict(prompt=PROMPTS[0], kw=dict(max_tokens=200, request_id="metrics-abort"),
                     abort_after_first="metrics-abort"))
    outs = [({"abort_after_first": j["abort_after_first"]} if "abort_after_first" in j else {})
            for j in jobs]
    threads = [threading.Thread(target=_stream, args=(router.address, j["prompt"], o),
                                kwargs=j["kw"]) for j, o in zip(jobs, outs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    router.wait_drained()
    time.sleep(0.6)  # one more poll reply: the ranks' stats after the last step
    after = _scrape(port)
    with Client(router.address, timeout=30) as client:
        timeline = client._stub.GetTimeline(router_pb2.TimelineRequest(since=since), timeout=30)
    return dict(outs=outs, before=before, after=after, timeline=timeline,
                transport=router.service.transport.name)


def test_request_counters_match_what_was_sent(run):
    outs, before, after = run["outs"], run["before"], run["after"]
    reasons = [o["last"].finish_reason for o in outs]
    assert reasons == ["length", "length", "length", "stop", "abort"]
    for reason, n in (("length", 3), ("stop", 1), ("abort", 1), ("error", 0)):
        assert _delta(after, before, "pdserve_requests_total", finish_reason=reason) == n, reason
    assert _delta(after, before, "pdserve_time_to_first_token_seconds_count") == 5
    assert _delta(after, before, "pdserve_e2e_request_latency_seconds_count") == 5
    gaps = sum(len(o["times"]) - 1 for o in outs)  # chunks <= tokens received
    assert 0 < _delta(after, before, "pdserve_inter_token_latency_seconds_count") <= gaps
    handoffs = _delta(after, before, "pdserve_kv_handoff_bytes_count")
    assert 4 <= handoffs <= 5  # the aborted one's may have been cut short
    moved = _delta(after, before, "pdserve_kv_handoff_bytes_sum")
    assert sum(o["last"].timings.kv_bytes for o in outs[:4]) <= moved
    assert moved <= sum(o["last"].timings.kv_bytes for o in outs)
    assert _delta(after, before, "pdserve_kv_handoff_seconds_count") == handoffs
    paths = {k[1][0][1] for k in after if k[0] == "pdserve_kv_deliveries_total"}
    assert paths == {run["transport"]}  # ray's deliveries, by their one path
    assert after[("pdserve_requests_in_flight", ())] == 0


def test_rank_gauges_and_counters(run):
    after = run["after"]
    for pool in ("prefill", "decode"):
        key = (("pool", pool), ("rank", "0"))
        assert after[("pdserve_rank_queue_depth", key)] == 0
        assert after[("pdserve_rank_kv_usage_ratio", key)] == 0.0  # drained
        assert after[("pdserve_rank_free_kv_blocks", key)] > 0
        assert ("pdserve_rank_empty_steps_total", key) in after
        assert ("pdserve_rank_preemptions_total", key) in after
        assert _delta(after, run["before"], "pdserve_rank_steps_total", pool=pool, rank="0") > 0


def test_ttft_breakdown_parts_fit_inside_the_client_ttft(run):
    for o in run["outs"][:4]:
        t = o["last"].timings
        parts = [t.router_queue_ms, t.prefill_queue_ms, t.prefill_ms, t.kv_export_ms]
        assert all(p >= 0 for p in parts) and t.kv_handoff_ms >= 0 and t.decode_queue_ms >= 0
        assert t.prefill_ms > 0 and t.kv_bytes > 0 and t.kv_handoff_ms > 0
        client_ttft, client_second = o["times"][0], o["times"][1]
        assert sum(parts) <= t.ttft_ms + 1.0
        assert t.ttft_ms <= client_ttft + TOL_MS
        # hand-off and the decode queue come after the first token, before the second
        assert t.ttft_ms + t.kv_handoff_ms + t.decode_queue_ms <= client_second + TOL_MS


def test_timeline_has_both_pools_with_consistent_kinds(run):
    steps = run["timeline"].steps
    by_pool: dict[str, list] = {}
    for s in steps:
        by_pool.setdefault(s.pool, []).append(s)
        assert s.start <= s.end
        assert s.kind in ("prompt", "decode", "empty_prompt", "empty", "import")
        if s.kind in ("prompt", "decode"):
            assert s.num_tokens > 0 and s.num_rows > 0
        elif s.kind != "import":
            assert s.num_tokens == 0 and s.num_rows == 0
        if s.num_handoffs:
            assert 0 < s.handoff_start <= s.handoff_end
    prefill, decode = by_pool["prefill"], by_pool["decode"]
    assert {s.kind for s in prefill} <= {"prompt", "empty_prompt", "empty"}
    assert {s.kind for s in decode} <= {"decode", "empty", "import"}
    assert sum(s.num_handoffs for s in prefill if s.kind == "prompt") >= 4
    assert sum(1 for s in decode if s.kind == "import") >= 4
    assert sum(s.num_tokens for s in decode if s.kind == "decode") >= 3 * 5 + 2
