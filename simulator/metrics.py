"""The summary ``bench serve`` prints and saves, from simulated client records.

The records are ``bench/serve_metrics.RequestRecord``s filled on virtual time (send,
one chunk per engine step that gave the request a token, end), and the summary is
``bench/serve.py summarize`` of one ``Run`` of them, so every field has vLLM's name
and meaning. ``summary_only`` drops the per-request lists (a million requests' ITLs
are more than a result file should hold).
"""

from __future__ import annotations

import math

from pdserve.bench.serve import Run, format_summary, summarize
from pdserve.bench.serve_metrics import per_request_lists
from pdserve.simulator.cluster import SimResult
from pdserve.simulator.collector import collector_paused

PER_REQUEST_KEYS = tuple(per_request_lists([]).keys())


def simulated_summary(sim: SimResult, *, label: str = "", request_rate: float = math.inf,
                      burstiness: float = 1.0, max_concurrency: int | None = None,
                      seed: int = 0, slos: dict[str, float] | None = None, percentiles=None,
                      summary_only: bool = False) -> dict:
    run = Run(sim.records, start=0.0, duration=sim.duration)
    with collector_paused():  # the lists of every chunk of every record: see collector.py
        result = summarize([run], address="simulated", label=label,
                           request_rate=request_rate, burstiness=burstiness,
                           max_concurrency=max_concurrency, seed=seed, slos=slos,
                           percentiles=percentiles)
    result["backend"] = "pdserve-simulated"
    result["simulation"] = sim.stats
    if summary_only:
        for key in PER_REQUEST_KEYS:
            result.pop(key, None)
    return result


__all__ = ["PER_REQUEST_KEYS", "format_summary", "simulated_summary"]
