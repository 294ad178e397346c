"""Recent TTFT and inter-token latency samples, for the planner and `pdserve status`.

The Prometheus histograms (metrics.py) count every sample since the router started,
in fixed buckets: they cannot say what the last minute looked like, nor which rank a
sample came from. These windows keep the last ``window_s`` seconds of samples (at most
``max_samples`` each, newest kept), each tagged with the rank that produced it, so the
planner can leave out ranks still warming up and samples taken before a pool changed.
The router records into them (``RouterService.latencies``) and shows their percentiles
in `pdserve status`; they live with the planner that judges them, so the planner needs
none of the router's modules (the router imports the planner, never the reverse).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

# Enough for a percentile to mean something under load, small enough to copy each
# planner tick (inter-token gaps arrive thousands per second on a busy router).
MAX_SAMPLES = 8192


@dataclass(frozen=True)
class LatencySample:
    at: float        # time.monotonic() when it was observed
    seconds: float
    pool: str        # the pool of the rank that produced it ("" when unknown)
    rank_uid: int    # RankHandle.uid within that pool (-1 when unknown)


class LatencyWindow:
    """The samples of the last ``window_s`` seconds (bounded by ``max_samples``)."""

    def __init__(self, window_s: float, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        self._samples: deque[LatencySample] = deque(maxlen=max_samples)

    def add(self, at: float, seconds: float, pool: str = "", rank_uid: int = -1) -> None:
        """On the router's event loop only: the one writer (expired samples go here)."""
        samples, horizon = self._samples, at - self.window_s
        while samples and samples[0].at < horizon:
            samples.popleft()
        samples.append(LatencySample(at, max(0.0, seconds), pool, rank_uid))

    def recent(self, now: float) -> tuple[LatencySample, ...]:
        """The samples observed after ``now - window_s``, oldest first. Reads only: the
        metrics endpoint calls it from its own thread (``tuple`` copies the deque in one
        C call, so a concurrent ``add`` cannot interleave)."""
        horizon = now - self.window_s
        return tuple(s for s in tuple(self._samples) if s.at >= horizon)

    def percentile(self, q: float, now: float) -> float | None:
        return percentile((s.seconds for s in self.recent(now)), q)


class RecentLatencies:
    """The router's two windows: TTFT (tagged with the prefill rank, or the normal rank,
    that produced the first token) and inter-token gaps (tagged with the decode rank)."""

    def __init__(self, window_s: float) -> None:
        self.ttft = LatencyWindow(window_s)
        self.itl = LatencyWindow(window_s)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, nearest rank) of ``values``; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    k = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(k, len(ordered)) - 1]
