"""The summary ``bench serve`` prints and saves, from the simulated clients' columns.

Field for field what ``bench/serve_report.py summarize`` gives for one ``Run`` of the same
requests as ``RequestRecord``s (vLLM's names and meanings; ``tests/simulator/
test_metrics.py`` checks the two agree), computed with numpy over ``client_log``'s
columns: ``summarize`` walks every chunk of every request several times in Python,
which at a million requests took minutes and most of the run's memory. Every simulated
chunk is one token, so the per-token ITLs are the per-chunk ones. Simulated clients get
no usage counts and no TTFT breakdowns: those fields are None, as in bench serve
without them. ``summary_only`` leaves out the per-request lists (a million requests'
ITLs are more than a result file should hold).
"""

from __future__ import annotations

import math
from datetime import datetime

import numpy as np

from pdserve.bench.serve_metrics import DEFAULT_PERCENTILES, latency_stats, per_request_lists
from pdserve.bench.serve_report import format_summary
from pdserve.simulator.client_log import ClientLog
from pdserve.simulator.cluster import SimResult
from pdserve.simulator.collector import collector_paused

# bench serve's per-request lists and the server's usage counts (one entry per request)
USAGE_KEYS = ("usage_prompt_tokens", "usage_completion_tokens", "usage_cached_tokens")
PER_REQUEST_KEYS = tuple(per_request_lists([]).keys()) + USAGE_KEYS


class Requests:
    """Per-request arrays of a run, as ``RequestRecord``'s properties compute them
    (``ttft``, ``e2el``, ``tpot``, ``success``, ``output_len``), and its chunk times."""

    def __init__(self, log: ClientLog) -> None:
        n = len(log)
        self.n = n
        self.kind = list(log.kind)
        self.error = list(log.error)
        self.finish_reason = list(log.finish_reason)
        # copies, not views: a view would pin the log's arrays (no append while it lives)
        self.prompt_len = np.array(log.prompt_len, dtype=np.int64)
        self.send = np.array(log.send_time, dtype=np.float64)
        end = np.array(log.end_time, dtype=np.float64)
        self.has_end = ~np.isnan(end)
        tokens = log.token_times()
        self.times, self.offsets = tokens.times, tokens.offsets
        self.num_tokens = tokens.counts  # one token a chunk: output_len is the chunk count
        self.has_chunks = self.num_tokens > 0
        first, last = self._first_and_last_chunk()
        self.ttft = np.where(self.has_chunks, first - self.send, 0.0)
        self.e2el = np.where(self.has_end, end, np.where(self.has_chunks, last, self.send)) \
            - self.send
        many = self.num_tokens > 1
        self.tpot = np.full(n, np.nan)  # None where output_len <= 1
        self.tpot[many] = (self.e2el[many] - self.ttft[many]) / (self.num_tokens[many] - 1)
        self.success = np.fromiter(
            (not e and r in ("stop", "length") for e, r in zip(self.error, self.finish_reason,
                                                             strict=True)),
            dtype=bool, count=n) & self.has_chunks

    def _first_and_last_chunk(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.times.size:
            return _floats(self.n), _floats(self.n)
        top = self.times.size - 1
        first = self.times[np.minimum(self.offsets[:-1], top)]
        last = self.times[np.maximum(self.offsets[1:] - 1, 0)]
        return first, last

    def chunk_owner(self) -> np.ndarray:
        """The request index of each entry of ``times``."""
        return np.repeat(np.arange(self.n, dtype=np.int32), self.num_tokens)

    def gaps(self) -> tuple[np.ndarray, np.ndarray]:
        """Every gap between a request's consecutive chunks (``RequestRecord.itls``),
        request after request, and the request each belongs to."""
        owner = self.chunk_owner()
        same = owner[1:] == owner[:-1]
        return np.diff(self.times)[same], owner[1:][same]

    def kinds(self) -> list[str]:
        return sorted({k for k in self.kind if k})

    def of_kind(self, kind: str) -> np.ndarray:
        return np.fromiter((k == kind for k in self.kind), dtype=bool, count=self.n)


def calculate_metrics(req: Requests, selected: np.ndarray, duration_s: float,
                      slos: dict[str, float] | None, percentiles, gaps) -> dict:
    """``serve_metrics.calculate_metrics`` of the requests ``selected`` (a mask);
    ``gaps``: ``req.gaps()``, computed once for every selection."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = selected & req.success
    completed = int(ok.sum())
    total_input = int(req.prompt_len[ok].sum())
    total_output = int(req.num_tokens[ok].sum())
    m: dict = {
        "duration": duration_s,
        "completed": completed,
        "failed": int(selected.sum()) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if slos:
        good = int(meets_slos(req, slos)[selected].sum())
        m["request_goodput"] = good / duration_s
        m["goodput_completed"] = good
        m["goodput_slos_ms"] = dict(slos)
    else:
        m["request_goodput"] = None
    gap_values, gap_owner = gaps
    itls = gap_values[ok[gap_owner]]
    tpots = req.tpot[ok & (req.num_tokens > 1)]
    m.update(latency_stats("ttft", req.ttft[ok], percentiles))
    m.update(latency_stats("tpot", tpots, percentiles))
    itl = latency_stats("itl", itls, percentiles)
    m.update(itl)
    # one token a chunk: each per-token ITL is its chunk's gap
    m.update({k.replace("_itl_", "_itl_per_token_", 1): v for k, v in itl.items()})
    m.update(latency_stats("e2el", req.e2el[ok], percentiles))
    m["max_output_tokens_per_s"] = peak_rate(req, selected)
    m["max_concurrent_requests"] = peak_concurrency(req, selected)
    return m


def meets_slos(req: Requests, slos: dict[str, float]) -> np.ndarray:
    """``serve_metrics.meets_slos`` of every request (TPOT of a one-token request is 0)."""
    values = {"ttft": req.ttft, "tpot": np.nan_to_num(req.tpot, nan=0.0), "e2el": req.e2el}
    good = req.success.copy()
    for name, ms in slos.items():
        good &= values[name] * 1000.0 <= ms
    return good


def peak_rate(req: Requests, selected: np.ndarray) -> float:
    """Peak output tokens over 1 s windows from the selection's first send
    (``serve_metrics._peak_rate``: every chunk counts, failed requests' too)."""
    if not (selected & req.has_chunks).any():
        return 0.0
    times = req.times if selected.all() else req.times[selected[req.chunk_owner()]]
    buckets = np.trunc(times - req.send[selected].min()).astype(np.int64)  # int(): toward 0
    return float(np.bincount(buckets - buckets.min()).max())


def peak_concurrency(req: Requests, selected: np.ndarray) -> int:
    """Most requests between send and end at once, an end before a start at the same
    instant (``serve_metrics._peak_concurrency``)."""
    counted = selected & (req.has_end | req.has_chunks)
    if not counted.any():
        return 0
    starts = req.send[counted]
    ends = starts + req.e2el[counted]
    times = np.concatenate([starts, ends])
    steps = np.concatenate([np.ones(starts.size, np.int64), -np.ones(ends.size, np.int64)])
    order = np.lexsort((steps, times))
    return max(0, int(np.cumsum(steps[order]).max()))


def per_request(req: Requests) -> dict:
    """``serve_metrics.per_request_lists`` (send offsets from 0, the simulated start)."""
    gaps = np.diff(req.times).tolist() if req.times.size else []
    starts, counts = req.offsets[:-1].tolist(), req.num_tokens.tolist()
    return {
        "input_lens": req.prompt_len.tolist(),
        "output_lens": counts,
        "ttfts": _or_none(req.ttft, req.has_chunks),
        "itls": [gaps[s:s + c - 1] if c else [] for s, c in zip(starts, counts, strict=True)],
        "e2els": _or_none(req.e2el, req.has_end),
        "tpots": _or_none(req.tpot, req.num_tokens > 1),
        "errors": list(req.error),
        "finish_reasons": list(req.finish_reason),
        "chunk_tokens": [[1] * c for c in counts],
        "request_ids": [str(i) for i in range(req.n)],
        "kinds": list(req.kind),
        "send_offsets": (req.send - 0.0).tolist(),
        "ttft_breakdowns": [None] * req.n,
    }


def simulated_summary(sim: SimResult, *, label: str = "", request_rate: float = math.inf,
                      burstiness: float = 1.0, max_concurrency: int | None = None,
                      seed: int = 0, slos: dict[str, float] | None = None, percentiles=None,
                      summary_only: bool = False) -> dict:
    """``summarize([Run(records, start=0.0, duration=sim.duration)], address="simulated",
    ...)`` of the run's requests, plus the simulation's own stats."""
    with collector_paused():  # a million per-request lists: see collector.py
        return _summary(sim, label, request_rate, burstiness, max_concurrency, seed, slos,
                        tuple(percentiles or DEFAULT_PERCENTILES), summary_only)


def _summary(sim: SimResult, label: str, request_rate: float, burstiness: float,
             max_concurrency: int | None, seed: int, slos: dict[str, float] | None,
             percentiles: tuple, summary_only: bool) -> dict:
    req = Requests(sim.log)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "pdserve-simulated",
        "label": label,
        "address": "simulated",
        "num_prompts": req.n,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "seed": seed,
        "temperature": 0.0,
        "ignore_eos": True,
        "percentiles": list(percentiles),
        "num_runs": 1,
    }
    everyone = np.ones(req.n, dtype=bool)
    gaps = req.gaps()
    overall = calculate_metrics(req, everyone, sim.duration, slos, percentiles, gaps)
    result.update(overall)
    by_kind = {}
    for kind in req.kinds():
        mask = req.of_kind(kind)
        by_kind[kind] = dict(overall) if mask.all() else calculate_metrics(
            req, mask, sim.duration, slos, percentiles, gaps)
    result["by_kind"] = by_kind
    result["ttft_breakdown"] = None
    result["start_unix_s"] = 0.0
    if not summary_only:
        result.update({key: [None] * req.n for key in USAGE_KEYS})
    result["prefix_cache_hit_rate"] = None
    result["prefix_cache_hit_rate_by_kind"] = {k: None for k in sorted(set(req.kind))}
    if not summary_only:
        result.update(per_request(req))
    result["cluster"] = None
    result["rank_step_deltas"] = None
    result["simulation"] = sim.stats
    return result


def _or_none(values: np.ndarray, present: np.ndarray) -> list:
    return [v if p else None for v, p in zip(values.tolist(), present.tolist(), strict=True)]


def _floats(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float64)


__all__ = ["PER_REQUEST_KEYS", "Requests", "format_summary", "simulated_summary"]
