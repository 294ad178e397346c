"""bench/autoscale.py's reading of a run: growth, the way back to the minima and the
requests' outcomes, from a hand-made pool timeline (the live runs are the bench's)."""

from __future__ import annotations

from pdserve.bench.autoscale import SCENARIOS, format_outcome, judge

START = 1_000.0


def _sample(t, prefill, decode, target=None):
    ready = {"prefill": prefill, "decode": decode}
    return {"t": t, "ready": ready, "starting": {}, "target": target or dict(ready),
            "num_inflight": 0, "ttft_p90_ms": 0.0, "itl_p90_ms": 0.0, "notes": {}}


def _result(samples, decisions, e2els, errors=None):
    n = len(e2els)
    return {"num_prompts": n, "completed": n - sum(1 for e in errors or [] if e),
            "errors": errors or [""] * n, "send_offsets": [float(i) for i in range(n)],
            "e2els": e2els,
            "pool_timeline": {"start_unix_s": START, "samples": samples,
                              "planner": {"decisions": decisions}}}


def test_growth_and_return_are_timed_from_decisions_and_samples():
    samples = [_sample(0, 1, 1), _sample(30, 1, 1, {"prefill": 2, "decode": 1}),
               _sample(40, 2, 1), _sample(60, 3, 1), _sample(130, 3, 1),
               _sample(200, 1, 1, {"prefill": 1, "decode": 1}), _sample(210, 1, 1)]
    decisions = [{"at": START + 31.2, "pool": "prefill", "from": 1, "to": 2, "outcome": "applied",
                  "reason": "TTFT p90 1400 ms > objective 1000 ms", "error": ""},
                 {"at": START + 195.0, "pool": "prefill", "from": 3, "to": 1,
                  "outcome": "applied", "reason": "idle for 61s", "error": ""}]
    # the last request ends at 3 + 117 = 120 s
    out = judge(SCENARIOS["ttft"], _result(samples, decisions, [1.0, 2.0, 3.0, 117.0]),
                {"prefill": (1, 3), "decode": (1, 2)})
    assert out.first_growth_s == {"prefill": 31.2, "decode": None}
    assert out.first_ready_s == {"prefill": 40, "decode": None}
    assert out.most_ready == {"prefill": 3, "decode": 1}
    assert out.load_end_s == 120.0 and out.left_minima
    assert out.back_to_minima_s == 80.0  # the sample at 200 s
    assert out.failed == 0 and out.completed == 4
    text = format_outcome(out)
    assert "prefill: first grew at 31.2 s" in text and "80.0 s later" in text


def test_a_run_that_never_grew_does_not_claim_a_return_and_failures_are_counted():
    samples = [_sample(0, 1, 1), _sample(50, 1, 1)]
    out = judge(SCENARIOS["itl"], _result(samples, [], [1.0, 2.0],
                                          errors=["", "UNAVAILABLE: no decode rank"]),
                {"prefill": (1, 3), "decode": (1, 2)})
    assert not out.left_minima and out.back_to_minima_s is None
    assert out.failed == 1 and out.errors == ["UNAVAILABLE: no decode rank"]
    assert "(never left them)" in format_outcome(out)


def test_a_pool_that_never_came_back_says_so():
    samples = [_sample(0, 1, 1), _sample(20, 1, 2), _sample(90, 1, 2)]
    out = judge(SCENARIOS["itl"], _result(samples, [], [10.0]),
                {"prefill": (1, 3), "decode": (1, 2)})
    assert out.left_minima and out.back_to_minima_s is None
    assert "not within the run" in format_outcome(out)
