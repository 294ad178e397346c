"""The router's window of recent latency samples: what it keeps, and its percentiles."""

from __future__ import annotations

from pdserve.planner.latency_window import LatencyWindow, percentile


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 90) is None


def test_the_window_keeps_the_last_seconds_and_at_most_its_bound():
    w = LatencyWindow(window_s=10.0, max_samples=5)
    for at in range(8):  # 8 samples, one a second: only the newest 5 stay
        w.add(float(at), at / 10, "prefill", 1)
    assert [s.at for s in w.recent(7.0)] == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert [s.at for s in w.recent(15.5)] == [6.0, 7.0]  # older than 10 s: left out
    assert w.percentile(100, 15.5) == 0.7
    assert w.recent(30.0) == () and w.percentile(90, 30.0) is None
    w.add(40.0, -1.0)  # a negative duration (clock granularity) counts as 0
    (s,) = w.recent(40.0)
    assert (s.seconds, s.pool, s.rank_uid) == (0.0, "", -1)
