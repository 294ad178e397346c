"""The router's Prometheus metrics: one registry per router, served as text over HTTP.

Request-level metrics are observed where events happen (the service and the gRPC
stream call the small hooks below); per-rank metrics are read at scrape time from the
engine stats each rank sends with every poll reply (so they are at most one poll
interval old). Names (all prefixed `pdserve_`) are documented in router/README.md.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "error")
# Seconds: 1 ms .. 60 s, denser where interactive serving lives.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 60.0)
# Bytes: 4 KiB .. 1 GiB in powers of 4.
BYTE_BUCKETS = tuple(float(4 ** k) for k in range(6, 16))
TTFT_PARTS = ("router_queue", "prefill_queue", "prefill", "kv_export", "kv_handoff",
              "decode_queue")


class RouterMetrics:
    """Metrics of one router; `service` (a RouterService) supplies the per-rank ones."""

    def __init__(self, service: Any = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Requests finished, by finish reason.",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Router-side TTFT: request received to first token streamed.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds",
                             "Gap between consecutive token-bearing messages of a stream.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Request received to its last message.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.phase = Histogram("pdserve_request_phase_seconds",
                               "Where requests' time went (the parts of GenerateResponse.timings).",
                               ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_bytes = Histogram("pdserve_kv_handoff_bytes",
                                  "Size of each KV payload handed from prefill to decode.",
                                  buckets=BYTE_BUCKETS, registry=r)
        self.handoff = Histogram("pdserve_kv_handoff_seconds",
                                 "Hand-off reported by the prefill rank to payload taken by "
                                 "the decode rank.", buckets=LATENCY_BUCKETS, registry=r)
        self.planner_decisions = Counter(
            "pdserve_planner_decisions", "Resizes the SLO planner decided, by pool, "
            "direction (up, down) and outcome (applied, failed, timed out).",
            ["pool", "direction", "outcome"], registry=r)
        if service is not None:
            r.register(_RankCollector(service))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    # -- hooks (called on the router's event loop) -----------------------------------

    def request_finished(self, state: Any, now: float) -> None:
        """Once per request, when its stream ends (`now`: time.monotonic())."""
        self.requests.labels(state.finish_reason or "error").inc()
        self.e2e.observe(max(0.0, now - state.created))
        if state.first_token_at is not None:
            self.ttft.observe(max(0.0, state.first_token_at - state.created))
        for part in TTFT_PARTS:
            value = state.timings.get(f"{part}_s")
            if value is not None:
                self.phase.labels(part).observe(value)

    def inter_token(self, gap_s: float) -> None:
        self.itl.observe(gap_s)

    def handed_off(self, nbytes: int, seconds: float) -> None:
        self.kv_bytes.observe(nbytes)
        self.handoff.observe(seconds)

    def planner_decided(self, pool: str, direction: str, outcome: str) -> None:
        self.planner_decisions.labels(pool, direction, outcome).inc()

    # -- exposition ------------------------------------------------------------------

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def start_server(self, host: str, port: int) -> int:
        """Serve the text format on http://host:port/ (any path); returns the bound port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_port)
        return self.port

    def stop_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _RankCollector:
    """Per-rank gauges and counters from each live rank's latest engine stats."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def describe(self):  # registered without a scrape at registration time
        return []

    def collect(self):
        labels = ["pool", "rank"]
        gauges = {
            "queue_depth": GaugeMetricFamily(
                "pdserve_rank_queue_depth", "Requests queued on the rank, not yet running "
                "(waiting prompts and payloads, prefilled requests awaiting decode).", labels=labels),
            "running": GaugeMetricFamily("pdserve_rank_running_requests",
                                         "Requests the rank's engine is running.", labels=labels),
            "kv_usage": GaugeMetricFamily("pdserve_rank_kv_usage_ratio",
                                          "Share of the rank's KV blocks in use.", labels=labels),
            "free_blocks": GaugeMetricFamily("pdserve_rank_free_kv_blocks",
                                             "Free KV blocks on the rank.", labels=labels),
            "inflight": GaugeMetricFamily("pdserve_rank_inflight_requests",
                                          "Requests the router has on the rank.", labels=labels),
        }
        counters = {
            "num_steps": CounterMetricFamily("pdserve_rank_steps", "Engine steps run.",
                                             labels=labels),
            "num_empty_steps": CounterMetricFamily(
                "pdserve_rank_empty_steps", "Empty steps (the rank idle while a pool peer "
                "worked).", labels=labels),
            "num_preemptions": CounterMetricFamily("pdserve_rank_preemptions",
                                                   "Sequences preempted.", labels=labels),
            "num_failed_steps": CounterMetricFamily(
                "pdserve_rank_failed_steps", "Steps whose model run raised (their requests "
                "moved).", labels=labels),
            "cache_queried_tokens": CounterMetricFamily(
                "pdserve_rank_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                "rank's prefix cache.", labels=labels),
            "cache_hit_tokens": CounterMetricFamily(
                "pdserve_rank_prefix_cache_hit_tokens", "Prompt tokens found in the rank's "
                "prefix cache (hit rate: hit / queried).", labels=labels),
            "cache_evictions": CounterMetricFamily(
                "pdserve_rank_prefix_cache_evictions", "Cached blocks whose KV was reused "
                "for other tokens.", labels=labels),
            "spec_drafts": CounterMetricFamily(
                "pdserve_rank_spec_decode_drafts", "Speculative drafts verified.",
                labels=labels),
            "spec_draft_tokens": CounterMetricFamily(
                "pdserve_rank_spec_decode_draft_tokens", "Tokens drafted.", labels=labels),
            "spec_accepted_tokens": CounterMetricFamily(
                "pdserve_rank_spec_decode_accepted_tokens", "Drafted tokens accepted "
                "(acceptance rate: accepted / draft tokens).", labels=labels),
        }
        per_pos = CounterMetricFamily(
            "pdserve_rank_spec_decode_accepted_tokens_per_pos", "Drafted tokens accepted, "
            "by their position in the draft (0: the first).", labels=[*labels, "position"])
        svc = self.service
        for pool in list(svc.pools.values()):
            for r in list(pool.ranks):
                if r.state == "dead":
                    continue
                st = r.stats
                lv = [pool.name, str(r.rank)]
                gauges["queue_depth"].add_metric(lv, st.num_waiting + st.num_prompted)
                gauges["running"].add_metric(lv, st.num_running)
                gauges["kv_usage"].add_metric(lv, float(st.kv_usage))
                gauges["free_blocks"].add_metric(lv, st.num_free_blocks)
                gauges["inflight"].add_metric(lv, len(r.inflight))
                for key, family in counters.items():
                    family.add_metric(lv, getattr(st, key))
                for pos, n in enumerate(st.spec_accepted_per_pos):
                    per_pos.add_metric([*lv, str(pos)], n)
        yield from gauges.values()
        yield from counters.values()
        yield per_pos
        inflight = GaugeMetricFamily("pdserve_requests_in_flight",
                                     "Requests accepted by the router and not released.")
        inflight.add_metric([], len(svc.tracker))
        yield inflight
        failures = CounterMetricFamily("pdserve_rank_failures", "Ranks the router saw die.")
        failures.add_metric([], svc.num_rank_failures)
        yield failures
        moves = CounterMetricFamily("pdserve_request_moves", "Attempts started again on "
                                    "another rank from a request's history (rank died, left, "
                                    "a step failed, a report was lost).")
        moves.add_metric([], svc.num_moves)
        yield moves
        paths = CounterMetricFamily("pdserve_kv_deliveries", "KV hand-offs delivered, by the "
                                    "path they took (device: cuda_ipc or pair_group).",
                                    labels=["path"])
        for path, n in svc.transport.delivery_paths().items():
            paths.add_metric([path], n)
        yield paths
        yield from _planner_families(svc)


def _planner_families(svc):
    """Pool targets, the recent latency percentiles the planner judges and, with
    autoscale, which pools it holds back (a scale-up that could not start)."""
    target = GaugeMetricFamily("pdserve_pool_target_replicas",
                               "Ranks each pool is at or being resized to.", labels=["pool"])
    for pool in list(svc.pools.values()):
        target.add_metric([pool.name], pool.target)
    yield target
    now = time.monotonic()
    recent = GaugeMetricFamily(
        "pdserve_recent_latency_seconds", "Percentiles of the router's recent TTFT and "
        "inter-token samples (the last planner_window_s seconds).",
        labels=["signal", "quantile"])
    for name, window in (("ttft", svc.latencies.ttft), ("itl", svc.latencies.itl)):
        for q in (50, 90, 99):
            value = window.percentile(q, now)
            if value is not None:
                recent.add_metric([name, str(q / 100)], value)
    yield recent
    planner = svc.planner
    enabled = GaugeMetricFamily("pdserve_planner_enabled", "1 when the SLO planner "
                                "(autoscale) sizes the pools.")
    enabled.add_metric([], 1 if planner is not None else 0)
    yield enabled
    if planner is not None:
        held = GaugeMetricFamily("pdserve_planner_held", "1 while the planner holds a pool "
                                 "at what is placed (its last scale-up could not start).",
                                 labels=["pool"])
        for pool in planner.policy.notes:
            held.add_metric([pool], 1 if planner.policy.held(pool, now) else 0)
        yield held
