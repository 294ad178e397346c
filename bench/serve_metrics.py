"""Serving metrics from client-side timings: pure arithmetic, no I/O, no clocks.

Conventions (the same as `vllm bench serve`, so the numbers read the same way):

- Every time is a `time.perf_counter()` reading taken by the client.
- TTFT = arrival of the first message that carries a token - the send time.
- E2EL = arrival of the stream's last message (the one with `finish_reason`) - send.
- ITL is per *chunk*: one gap per token-bearing message after the first, whatever the
  number of tokens it carries (vLLM's `itl`). pdserve's router sends one message per
  engine step, so a chunk is usually one token; when a message carries k > 1 tokens
  its gap counts once in `*_itl_ms`, and `*_itl_per_token_ms` spreads it evenly: k
  entries of gap / k (so the per-token ITLs of a request add up to e2el - ttft minus
  any tail after the last token).
- TPOT = (e2el - ttft) / (output_tokens - 1) for requests with more than one output
  token; for goodput a one-token request counts TPOT as 0 (as vLLM does).
- output_tokens is the number of token ids the client received, counted by the
  client (not the server's usage field, which is kept beside it for checking).
- Goodput (`--goodput ttft:MS tpot:MS e2el:MS`): completed requests meeting every
  given SLO, per second of the run.
- Percentiles are numpy's default (linear interpolation); an empty list gives 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """What the client saw of one request (times are perf_counter seconds)."""

    prompt_len: int
    expected_output_len: int = 0
    kind: str = ""  # dataset class, e.g. "short" / "long" in the mixed workload
    send_time: float = 0.0
    scheduled_time: float = 0.0  # when the arrival process wanted it sent
    chunk_times: list[float] = field(default_factory=list)  # token-bearing messages only
    chunk_tokens: list[int] = field(default_factory=list)
    end_time: float | None = None  # last message of the stream
    request_id: str = ""
    finish_reason: str = ""
    error: str = ""
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None  # prompt tokens the server took from its cache
    # Server-side TTFT breakdown of this request, when the router reports one (a
    # `timings` message on the last GenerateResponse, e.g. router_queue_ms,
    # prefill_queue_ms, prefill_ms, kv_handoff_ms, decode_queue_ms); kept as-is in
    # the JSON's `ttft_breakdowns`, in request order, beside `request_ids`.
    breakdown: dict | None = None

    @property
    def success(self) -> bool:
        return not self.error and self.finish_reason in ("stop", "length") and bool(self.chunk_times)

    @property
    def output_len(self) -> int:
        return int(sum(self.chunk_tokens))

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time if self.chunk_times else 0.0

    @property
    def e2el(self) -> float:
        end = self.end_time if self.end_time is not None else (
            self.chunk_times[-1] if self.chunk_times else self.send_time)
        return end - self.send_time

    @property
    def itls(self) -> list[float]:
        """Per-chunk gaps (vLLM's convention)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def itls_per_token(self) -> list[float]:
        """Each gap divided evenly over the tokens of the chunk that ends it."""
        out: list[float] = []
        for gap, k in zip(self.itls, self.chunk_tokens[1:], strict=False):
            if k > 0:
                out.extend([gap / k] * k)
        return out

    @property
    def tpot(self) -> float | None:
        n = self.output_len
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    def record_message(self, now: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunk_times.append(now)
            self.chunk_tokens.append(num_tokens)


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        for part in str(item).replace(",", " ").split():
            name, sep, value = part.partition(":")
            name = name.strip().lower()
            if not sep or name not in GOODPUT_METRICS:
                raise ValueError(f"--goodput takes NAME:MS with NAME one of "
                                 f"{'/'.join(GOODPUT_METRICS)}, got {part!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput {part!r}: {value!r} is not a number") from None
            if ms < 0:
                raise ValueError(f"--goodput {part!r}: the SLO must be >= 0 ms")
            slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """vLLM's rule: every given SLO holds (TPOT of a one-token request counts as 0)."""
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(values[name] * 1000.0 <= ms for name, ms in slos.items())


def latency_stats(name: str, values_s: Sequence[float],
                  percentiles: Sequence[float]) -> dict[str, float]:
    """``mean_/median_/std_/p<q>_<name>_ms`` of ``values_s`` (seconds), vLLM's field
    names; zeros when empty. The one definition bench serve and the simulator share."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    have = arr.size > 0
    out = {
        f"mean_{name}_ms": float(arr.mean()) if have else 0.0,
        f"median_{name}_ms": float(np.median(arr)) if have else 0.0,
        f"std_{name}_ms": float(arr.std()) if have else 0.0,
    }
    for p in percentiles:
        out[f"p{_pct_label(p)}_{name}_ms"] = float(np.percentile(arr, p)) if have else 0.0
    return out


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def calculate_metrics(records: Sequence[RequestRecord], duration_s: float,
                      slos: dict[str, float] | None = None,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """The summary `vllm bench serve` prints and saves, from the client's records."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in ok)
    output_lens = [r.output_len if r.success else 0 for r in records]
    total_output = sum(output_lens)
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [g for r in ok for g in r.itls]
    itls_tok = [g for r in ok for g in r.itls_per_token]
    e2els = [r.e2el for r in ok]
    m: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if slos:
        good = sum(1 for r in records if meets_slos(r, slos))
        m["request_goodput"] = good / duration_s
        m["goodput_completed"] = good
        m["goodput_slos_ms"] = dict(slos)
    else:
        m["request_goodput"] = None
    m.update(latency_stats("ttft", ttfts, percentiles))
    m.update(latency_stats("tpot", tpots, percentiles))
    m.update(latency_stats("itl", itls, percentiles))
    m.update(latency_stats("itl_per_token", itls_tok, percentiles))
    m.update(latency_stats("e2el", e2els, percentiles))
    # Peak output tokens/s over 1 s windows, counted from chunk arrivals.
    m["max_output_tokens_per_s"] = _peak_rate(records)
    m["max_concurrent_requests"] = _peak_concurrency(records)
    return m


def _peak_rate(records: Sequence[RequestRecord]) -> float:
    times = [(t, k) for r in records for t, k in zip(r.chunk_times, r.chunk_tokens, strict=False)]
    if not times:
        return 0.0
    start = min(r.send_time for r in records)
    buckets: dict[int, int] = {}
    for t, k in times:
        b = int(t - start)
        buckets[b] = buckets.get(b, 0) + k
    return float(max(buckets.values()))


def _peak_concurrency(records: Sequence[RequestRecord]) -> int:
    events = []
    for r in records:
        if r.end_time is None and not r.chunk_times:
            continue
        events.append((r.send_time, 1))
        events.append((r.send_time + r.e2el, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def per_request_lists(records: Sequence[RequestRecord], start_time: float | None = None) -> dict:
    """vLLM's per-request lists (seconds), plus pdserve's: finish reasons, chunk sizes,
    request ids (to join server-side data), kinds, send times relative to `start_time`
    (default: the earliest send), and a slot for per-request TTFT breakdowns."""
    t0 = start_time if start_time is not None else min((r.send_time for r in records), default=0.0)
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len for r in records],
        "ttfts": [r.ttft if r.chunk_times else None for r in records],
        "itls": [r.itls for r in records],
        "e2els": [r.e2el if r.end_time is not None else None for r in records],
        "tpots": [r.tpot for r in records],
        "errors": [r.error for r in records],
        "finish_reasons": [r.finish_reason for r in records],
        "chunk_tokens": [r.chunk_tokens for r in records],
        "request_ids": [r.request_id for r in records],
        "kinds": [r.kind for r in records],
        "send_offsets": [r.send_time - t0 for r in records],
        "ttft_breakdowns": [r.breakdown for r in records],
    }


# Parts of GenerateResponse.timings (router/README.md): the first four lie inside the
# TTFT (the first token is streamed once the prefill rank reports it); ttft_ms is the
# router's own view of it; hand-off and decode queue come after the first token.
TTFT_PARTS = ("router_queue_ms", "prefill_queue_ms", "prefill_ms", "kv_export_ms")
BREAKDOWN_FIELDS = TTFT_PARTS + ("ttft_ms", "kv_handoff_ms", "decode_queue_ms", "kv_bytes")


def breakdown_summary(records: Sequence[RequestRecord],
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict | None:
    """Mean, median and percentiles of each part of the router's per-request TTFT
    breakdowns (successful requests that carry one), plus `transit_ms` (the router's
    TTFT minus its parts: Ray calls and polls) and `client_ttft_ms` over the same
    requests. None when no request carries a breakdown."""
    rows = [(r, r.breakdown) for r in records if r.success and r.breakdown]
    if not rows:
        return None
    columns = {k: [float(b.get(k, 0.0)) for _, b in rows] for k in BREAKDOWN_FIELDS}
    columns["transit_ms"] = [float(b.get("ttft_ms", 0.0)) - sum(float(b.get(k, 0.0))
                                                                for k in TTFT_PARTS)
                             for _, b in rows]
    columns["client_ttft_ms"] = [r.ttft * 1000.0 for r, _ in rows]
    out: dict = {"num_requests": len(rows)}
    for key, values in columns.items():
        arr = np.asarray(values, dtype=np.float64)
        stats = {"mean": float(arr.mean()), "median": float(np.median(arr))}
        for p in percentiles:
            stats[f"p{_pct_label(p)}"] = float(np.percentile(arr, p))
        out[key] = stats
    return out


def metrics_by_kind(records: Sequence[RequestRecord], duration_s: float,
                    slos: dict[str, float] | None = None,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, dict]:
    """The summary for each dataset class separately (e.g. short chats vs long prompts)."""
    kinds = sorted({r.kind for r in records if r.kind})
    return {k: calculate_metrics([r for r in records if r.kind == k], duration_s, slos,
                                 percentiles) for k in kinds}
