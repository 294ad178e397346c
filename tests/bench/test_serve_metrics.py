"""Metric arithmetic on hand-made timings (no clocks, no server)."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.serve_metrics import (
    RequestRecord,
    calculate_metrics,
    meets_slos,
    metrics_by_kind,
    parse_goodput,
    per_request_lists,
)


def rec(prompt_len, send, chunks, end, *, finish="length", error="", kind="") -> RequestRecord:
    r = RequestRecord(prompt_len=prompt_len, send_time=send, kind=kind)
    for t, k in chunks:
        r.record_message(t, k)
    r.end_time = end
    r.finish_reason = finish
    r.error = error
    return r


@pytest.fixture
def records():
    a = rec(10, 10.0, [(10.1, 1), (10.15, 1), (10.25, 2)], 10.25, kind="short")  # 4 tokens
    b = rec(20, 10.0, [(10.3, 1)], 10.3, kind="long")                            # 1 token
    c = rec(30, 10.5, [], None, finish="", error="UNAVAILABLE: gone", kind="short")
    d = rec(40, 11.0, [(11.2, 1), (11.4, 1), (11.6, 1), (11.65, 0)], 11.65, kind="short")
    return [a, b, c, d]


def test_per_request_conventions(records):
    a, b, c, d = records
    assert a.output_len == 4 and a.chunk_tokens == [1, 1, 2]
    assert a.ttft == pytest.approx(0.1)
    assert a.e2el == pytest.approx(0.25)
    assert a.itls == pytest.approx([0.05, 0.10])            # one gap per chunk (vLLM)
    assert a.itls_per_token == pytest.approx([0.05, 0.05, 0.05])  # the 2-token chunk split
    assert a.tpot == pytest.approx((0.25 - 0.1) / 3)
    assert b.tpot is None and b.itls == []
    assert not c.success and c.output_len == 0
    # A last message without tokens ends the stream but is not a chunk.
    assert d.chunk_times == pytest.approx([11.2, 11.4, 11.6])
    assert d.e2el == pytest.approx(0.65)
    assert d.tpot == pytest.approx((0.65 - 0.2) / 2)


def test_summary_matches_hand_computation(records):
    m = calculate_metrics(records, duration_s=2.0, percentiles=(50, 99))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 10 + 20 + 40  # failed requests' prompts not counted
    assert m["total_output_tokens"] == 4 + 1 + 3
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(39.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)  # linear: 200 + 0.98 * 100
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert m["mean_tpot_ms"] == pytest.approx((50 + 225) / 2)  # 1-token requests left out
    assert m["mean_itl_ms"] == pytest.approx((50 + 100 + 200 + 200) / 4)
    assert m["median_itl_ms"] == pytest.approx(150.0)
    assert m["mean_itl_per_token_ms"] == pytest.approx((50 * 3 + 200 * 2) / 5)
    assert m["mean_e2el_ms"] == pytest.approx((250 + 300 + 650) / 3)
    assert m["p50_e2el_ms"] == pytest.approx(300.0)
    assert m["request_goodput"] is None  # no SLOs given
    assert m["max_concurrent_requests"] == 2
    assert m["max_output_tokens_per_s"] == 5  # 4 + 1 tokens in the first second


@pytest.mark.parametrize("slos,good", [
    ({"ttft": 250}, 2),                 # a and d; b's 300 ms misses
    ({"tpot": 100}, 2),                 # a (50) and b (1 token counts as 0); d 225 misses
    ({"ttft": 250, "tpot": 100}, 1),    # every SLO must hold
    ({"e2el": 301}, 2),                 # a (250) and b (300); d (650) misses
    ({"ttft": 1e9, "tpot": 1e9, "e2el": 1e9}, 3),  # the failed request is never good
])
def test_goodput(records, slos, good):
    m = calculate_metrics(records, duration_s=2.0, slos=slos)
    assert m["goodput_completed"] == good
    assert m["request_goodput"] == pytest.approx(good / 2.0)
    assert sum(meets_slos(r, slos) for r in records) == good


def test_parse_goodput():
    assert parse_goodput(["ttft:200", "tpot:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    assert parse_goodput(["ttft:1,e2el:9"]) == {"ttft": 1.0, "e2el": 9.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_empty_and_all_failed():
    failed = [rec(5, 0.0, [], None, finish="error", error="boom")]
    m = calculate_metrics(failed, 1.0, slos={"ttft": 10})
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0
    assert m["request_goodput"] == 0.0
    with pytest.raises(ValueError):
        calculate_metrics(failed, 0.0)


def test_finish_error_is_a_failure():
    r = rec(5, 0.0, [(0.1, 1)], 0.2, finish="error", error="rank died")
    assert not r.success
    assert calculate_metrics([r], 1.0)["completed"] == 0


def test_lists_and_by_kind(records):
    lists = per_request_lists(records, start_time=10.0)
    assert lists["output_lens"] == [4, 1, 0, 3]
    assert lists["input_lens"] == [10, 20, 30, 40]
    assert lists["errors"][2].startswith("UNAVAILABLE")
    assert lists["send_offsets"] == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert lists["ttfts"][2] is None and lists["ttfts"][0] == pytest.approx(0.1)
    assert lists["itls"][0] == pytest.approx([0.05, 0.10])
    assert lists["ttft_breakdowns"] == [None] * 4
    kinds = metrics_by_kind(records, 2.0)
    assert set(kinds) == {"short", "long"}
    assert kinds["short"]["completed"] == 2 and kinds["short"]["failed"] == 1
    assert kinds["long"]["mean_ttft_ms"] == pytest.approx(300.0)


def test_breakdown_absent_until_the_router_sends_one():
    from pdserve.bench.serve_client import _breakdown
    from pdserve.rpc import router_pb2

    assert _breakdown(router_pb2.GenerateResponse(finish_reason="length")) is None

    class Later:  # a proto that has the field but left it unset
        def HasField(self, name):
            return False

    assert _breakdown(Later()) is None


def test_runs_merge_into_one_result(records):
    from pdserve.bench.serve_client import Run
    from pdserve.bench.serve_report import summarize

    a, b, c, d = records
    counters = {"counters": {"decode/0": {"num_steps": 10, "num_empty_steps": 1}}}
    later = {"counters": {"decode/0": {"num_steps": 15, "num_empty_steps": 1}}}
    runs = [Run([a, b], start=10.0, duration=0.5, before=counters, after=later),
            Run([c, d], start=10.5, duration=1.5, before=counters, after=later)]
    r = summarize(runs, slos={"ttft": 250}, percentiles=(99,))
    whole = calculate_metrics(records, 2.0, {"ttft": 250}, (99,))
    for key in ("completed", "failed", "duration", "request_throughput", "p99_ttft_ms",
                "mean_itl_ms", "request_goodput", "total_output_tokens"):
        assert r[key] == pytest.approx(whole[key]), key
    assert r["num_runs"] == 2 and r["output_lens"] == [4, 1, 0, 3]
    assert r["send_offsets"] == pytest.approx([0.0, 0.0, 0.0, 0.5])  # per run's own start
    assert r["rank_step_deltas"] == {"decode/0": {"num_steps": 10, "num_empty_steps": 0}}
