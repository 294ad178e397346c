"""The router's per-request TTFT breakdown in the benchmark's JSON, and the step
timeline picture: arithmetic on hand-made data, then one real run with --timeline."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serve_metrics import RequestRecord, breakdown_summary

TOL_S = 0.025  # the router's clock against the client's


def _rec(ttft: float, breakdown: dict | None) -> RequestRecord:
    r = RequestRecord(prompt_len=8, send_time=0.0, finish_reason="length", end_time=ttft + 0.1)
    r.record_message(ttft, 1)
    r.record_message(ttft + 0.1, 1)
    r.breakdown = breakdown
    return r


def test_breakdown_summary_on_hand_made_timings():
    parts = dict(router_queue_ms=1.0, prefill_queue_ms=2.0, prefill_ms=10.0, kv_export_ms=1.0,
                 ttft_ms=20.0, kv_handoff_ms=3.0, decode_queue_ms=4.0, kv_bytes=1000)
    recs = [_rec(0.025, parts), _rec(0.035, dict(parts, prefill_ms=20.0, ttft_ms=30.0)),
            _rec(0.05, None)]
    s = breakdown_summary(recs, percentiles=(50, 99))
    assert s["num_requests"] == 2
    assert s["prefill_ms"]["mean"] == pytest.approx(15.0)
    assert s["prefill_ms"]["median"] == pytest.approx(15.0)
    assert s["prefill_ms"]["p99"] == pytest.approx(19.9)
    assert s["transit_ms"]["mean"] == pytest.approx(6.0)  # ttft - the four TTFT parts
    assert s["client_ttft_ms"]["mean"] == pytest.approx(30.0)
    assert s["kv_bytes"]["mean"] == 1000
    assert breakdown_summary([_rec(0.05, None)]) is None


def test_breakdown_read_from_the_last_response():
    from pdserve.bench.serve_client import _breakdown
    from pdserve.rpc import router_pb2

    msg = router_pb2.GenerateResponse(finish_reason="length", timings=router_pb2.Timings(
        prefill_ms=2.5, kv_bytes=1 << 40))
    b = _breakdown(msg)
    assert b["prefill_ms"] == 2.5 and b["router_queue_ms"] == 0.0 and b["kv_bytes"] == 1 << 40


def _steps():
    recs = []
    t = 1000.0
    for _ in range(30):
        recs.append(dict(pool="prefill", rank=0, kind="prompt", start=t, end=t + 0.05,
                         num_tokens=64, num_rows=1, num_handoffs=1, handoff_start=t + 0.05,
                         handoff_end=t + 0.052))
        recs.append(dict(pool="decode", rank=0, kind="import", start=t + 0.06, end=t + 0.062,
                         num_tokens=0, num_rows=1, num_handoffs=1, handoff_start=t + 0.06,
                         handoff_end=t + 0.062))
        for j, kind in enumerate(("decode", "empty")):
            recs.append(dict(pool="decode", rank=j, kind=kind, start=t + 0.07, end=t + 0.09,
                             num_tokens=4 if kind == "decode" else 0, num_rows=4 if j == 0 else 0,
                             num_handoffs=0, handoff_start=0.0, handoff_end=0.0))
        t += 0.1
    return recs


def test_timeline_picture_from_hand_made_steps(tmp_path):
    from pdserve.bench.plots import plot_timeline, timeline_window

    steps = _steps()
    lo, hi = timeline_window(steps)
    assert 1000.0 <= lo < hi <= 1003.0
    path = plot_timeline(steps, tmp_path / "t.png")
    assert path.stat().st_size > 10_000
    with pytest.raises(ValueError):
        plot_timeline([], tmp_path / "none.png")


def test_step_ring_is_bounded_and_names_empty_steps():
    from types import SimpleNamespace

    from pdserve.rank.step_timeline import StepTimeline

    ring = StepTimeline(maxlen=4)
    for i, (kind, n) in enumerate([("prompt", 9), ("decode", 3), ("decode", 0),
                                   ("empty_prompt", 0), ("decode", 2)]):
        out = SimpleNamespace(kind=kind, num_scheduled_tokens=n, duration_s=0.5, num_rows=n,
                              handoffs=[1] if kind == "prompt" else [])
        ring.step("decode", 1, out, end=10.0 + i)
    ring.imported("decode", 1, 15.0, 15.25)
    recs = ring.since()
    assert [r["seq"] for r in recs] == [3, 4, 5, 6]  # the oldest two fell off
    assert [r["kind"] for r in recs] == ["empty", "empty_prompt", "decode", "import"]
    assert recs[0]["start"] == 11.5 and recs[0]["end"] == 12.0
    assert [r["seq"] for r in ring.since(since=13.5)] == [5, 6]
    assert [r["seq"] for r in ring.since(since_seq=5)] == [6]


def test_cli_breakdown_and_timeline_from_a_real_run(router_address, tiny_model_dir, tmp_path):
    from pdserve.bench.serve import main as serve_main

    out, png = tmp_path / "serve.json", tmp_path / "timeline.png"
    rc = serve_main(["--address", router_address, "--model", tiny_model_dir,
                     "--num-prompts", "4", "--random-input-len", "40", "--random-output-len",
                     "5", "--request-rate", "40", "--disable-tqdm", "--no-plot",
                     "--result-file", str(out), "--timeline", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4
    for ttft, b in zip(r["ttfts"], r["ttft_breakdowns"], strict=True):
        assert all(v >= 0 for v in b.values())
        inside = b["router_queue_ms"] + b["prefill_queue_ms"] + b["prefill_ms"] + b["kv_export_ms"]
        assert b["prefill_ms"] > 0 and b["kv_bytes"] > 0
        assert inside <= b["ttft_ms"] + 1.0
        assert b["ttft_ms"] / 1e3 <= ttft + TOL_S
    s = r["ttft_breakdown"]
    assert s["num_requests"] == 4 and set(s["prefill_ms"]) == {"mean", "median", "p50", "p90", "p99"}
    assert png.stat().st_size > 10_000
    steps = json.loads(png.with_suffix(".json").read_text())["steps"]
    pools = {s["pool"] for s in steps}
    assert pools == {"prefill", "decode"}
    assert all(s["end"] >= r["start_unix_s"] for s in steps)
    assert sum(s["num_tokens"] for s in steps if s["kind"] == "prompt") >= 4 * 20
    assert sum(1 for s in steps if s["kind"] == "import") >= 4
