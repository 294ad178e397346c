"""`bench serve`'s client: sends a workload to a router on its arrival schedule and
records, per request, what the client sees (`collect` -> `Run`).

Every time is measured by this client with `time.perf_counter()` (conventions in
`serve_metrics.py`); `serve_report.py` turns the records into the result dict.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc
from tqdm import tqdm

from pdserve.bench.datasets import arrival_offsets
from pdserve.bench.load_timeline import PoolSampler
from pdserve.bench.serve_metrics import RequestRecord
from pdserve.router.client import AsyncClient


async def _stream_one(client, req, rec, *, temperature: float, ignore_eos: bool,
                      timeout: float | None) -> None:
    """Send one request and record, as messages arrive, what the client sees."""
    rec.send_time = time.perf_counter()
    try:
        async for msg in client.stream(req.prompt, max_tokens=req.output_len,
                                       temperature=temperature, ignore_eos=ignore_eos,
                                       timeout=timeout):
            now = time.perf_counter()
            rec.record_message(now, len(msg.token_ids))
            if msg.request_id:
                rec.request_id = msg.request_id
            if msg.finish_reason:
                rec.end_time = now
                rec.finish_reason = msg.finish_reason
                rec.error = msg.error
                rec.usage_prompt_tokens = msg.usage.prompt_tokens
                rec.usage_completion_tokens = msg.usage.completion_tokens
                rec.usage_cached_tokens = getattr(msg.usage, "cached_prompt_tokens", 0)
                rec.breakdown = _breakdown(msg)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        rec.error = f"{getattr(code, 'name', 'RPC_ERROR')}: {exc.details() if hasattr(exc, 'details') else exc}"
    except Exception as exc:  # anything else is the request's error, not the run's
        rec.error = f"{type(exc).__name__}: {exc}"
    if not rec.finish_reason and not rec.error:
        rec.error = "the stream ended without a finish_reason"
    if rec.finish_reason == "error" and not rec.error:
        rec.error = "finish_reason error"


def _breakdown(msg) -> dict | None:
    """The router's per-request TTFT breakdown: the `timings` field of the last
    GenerateResponse as a dict of every field (ms; kv_bytes an int), or None."""
    try:
        if not msg.HasField("timings"):
            return None
    except ValueError:  # no such field in this proto
        return None
    t = msg.timings
    return {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields}


async def fetch_timeline(address: str, since: float,
                         client_options: dict | None = None) -> list[dict]:
    """The router's step records of every live rank since unix time `since`."""
    async with AsyncClient(address, timeout=60, **(client_options or {})) as client:
        return await client.timeline(since)


def _rank_counters(state) -> dict:
    """Per-rank step counters from GetClusterState (for before/after deltas)."""
    out = {}
    for pool in state.pools:
        for r in pool.ranks:
            out[f"{pool.name}/{r.rank}"] = {"num_steps": int(r.num_steps),
                                            "num_empty_steps": int(r.num_empty_steps),
                                            "num_preemptions": int(r.num_preemptions)}
    return out


async def _cluster_info(client) -> dict | None:
    """The cluster's shape and step counters; None from a client that cannot ask for
    them (the OpenAI backend) or a router that did not answer."""
    if not hasattr(client, "cluster_state"):
        return None
    try:
        state = await client.cluster_state()
    except Exception:
        return None
    return {"mode": state.mode, "model": state.model, "kv_transport": state.kv_transport,
            "pools": {p.name: len(p.ranks) for p in state.pools},
            "counters": _rank_counters(state)}


@dataclass
class Run:
    """One pass of a workload over a router: the client's records and the clocks."""

    records: list
    start: float
    duration: float
    before: dict | None = None  # GetClusterState before and after (step counters)
    after: dict | None = None
    wall_start: float = 0.0  # time.time() at `start` (to ask the ranks for their steps)
    sampler: object = None  # load_timeline.PoolSampler, when the pools were sampled


@dataclass
class _StreamOptions:
    """How every request of a run is asked for."""

    temperature: float
    ignore_eos: bool
    timeout: float | None


async def _warm_up(client, address: str, requests: list, num_warmups: int,
                   options: _StreamOptions) -> None:
    """Short untimed requests first: they connect and warm the ranks."""
    for i in range(num_warmups):
        req = requests[i % len(requests)]
        warm = RequestRecord(prompt_len=req.prompt_len)
        await _stream_one(client, type(req)(req.prompt, req.prompt_len, min(4, req.output_len)),
                          warm, temperature=options.temperature, ignore_eos=options.ignore_eos,
                          timeout=options.timeout or 300)
        if not warm.success:
            raise RuntimeError(f"warm-up request to {address} failed: {warm.error}")


def _send_offsets(requests: list, offsets: list[float] | None, request_rate: float,
                  burstiness: float, seed: int) -> list[float]:
    """The given send times, checked, or the rate's arrival process."""
    if offsets is None:
        return arrival_offsets(len(requests), request_rate, burstiness, seed)
    if len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} send times for {len(requests)} requests")
    return offsets


def _pool_sampler(client, interval_s: float | None):
    """A PoolSampler of the client's cluster every `interval_s`, or None."""
    if interval_s is None or not hasattr(client, "cluster_state"):
        return None

    return PoolSampler(client, interval_s)


@dataclass
class _Sender:
    """Sends each request at its time (a conversation's turn once the last one ended),
    at most `semaphore`'s count in flight, into its record."""

    client: Any
    requests: list
    offsets: list[float]
    records: list
    options: _StreamOptions
    semaphore: asyncio.Semaphore | None
    bar: Any  # a tqdm progress bar
    done: list[asyncio.Event]
    start: float = 0.0  # perf_counter() at the run's start, that offsets count from

    async def send(self, i: int) -> None:
        rec = self.records[i]
        rec.scheduled_time = self.start + self.offsets[i]
        delay = rec.scheduled_time - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        after = getattr(self.requests[i], "after", None)
        if after is not None:  # a conversation's next turn: once the last one ended
            await self.done[after].wait()
            rec.scheduled_time = max(rec.scheduled_time, time.perf_counter())
        try:
            if self.semaphore is None:
                await self._stream(i)
            else:
                async with self.semaphore:
                    await self._stream(i)
        finally:
            self.done[i].set()
        self.bar.update(1)

    async def _stream(self, i: int) -> None:
        await _stream_one(self.client, self.requests[i], self.records[i],
                          temperature=self.options.temperature,
                          ignore_eos=self.options.ignore_eos, timeout=self.options.timeout)

    async def send_all(self, sampler, hold_s: float) -> tuple[float, float]:
        """Every request on its schedule, then quiet until `hold_s` after the start;
        (time.time() at the start, seconds until the last request ended)."""
        wall_start, self.start = time.time(), time.perf_counter()
        if sampler is not None:
            sampler.start(self.start)
        try:
            await asyncio.gather(*(self.send(i) for i in range(len(self.requests))))
            duration = time.perf_counter() - self.start
            self.bar.close()
            rest = hold_s - (time.perf_counter() - self.start)
            if rest > 0:  # the schedule's quiet end: the pools settle, the sampler watches
                print(f"load done; watching the pools for {rest:.0f} s more", file=sys.stderr)
                await asyncio.sleep(rest)
        finally:
            if sampler is not None:
                await sampler.stop()
        return wall_start, duration


def _sender(client, requests: list, offsets: list[float], options: _StreamOptions,
            max_concurrency: int | None, progress: bool, label: str) -> _Sender:
    records = [RequestRecord(prompt_len=r.prompt_len, expected_output_len=r.output_len,
                             kind=r.kind) for r in requests]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc=label or "requests",
               file=sys.stderr, leave=False)
    return _Sender(client, requests, offsets, records, options, sem, bar,
                   [asyncio.Event() for _ in requests])


async def collect(address: str, requests: list, *, request_rate: float = math.inf,
                  burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                  temperature: float = 0.0, ignore_eos: bool = True,
                  request_timeout: float | None = None, num_warmups: int = 1,
                  progress: bool = True, client=None, label: str = "",
                  client_options: dict | None = None, offsets: list[float] | None = None,
                  hold_s: float = 0.0, sample_interval_s: float | None = None) -> Run:
    """Send `requests` (datasets.SampleRequest) on their arrival schedule; record each.

    `client` is anything with AsyncClient's `stream(prompt, **kw)` (and, optionally,
    `cluster_state()`); by default an AsyncClient on `address` (with `client_options`:
    token, TLS), closed at the end. `offsets` (send times, e.g. a rate schedule's)
    replace the rate's arrival process; the run lasts `hold_s` at least; with
    `sample_interval_s` a `PoolSampler` records the pools meanwhile (`Run.sampler`).
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    own_client = client is None
    if own_client:
        client = AsyncClient(address, **(client_options or {}))
    options = _StreamOptions(temperature, ignore_eos, request_timeout)
    try:
        await _warm_up(client, address, requests, num_warmups, options)
        before = await _cluster_info(client)
        offsets = _send_offsets(requests, offsets, request_rate, burstiness, seed)
        sampler = _pool_sampler(client, sample_interval_s)
        sender = _sender(client, requests, offsets, options, max_concurrency, progress, label)
        wall_start, duration = await sender.send_all(sampler, hold_s)
        after = await _cluster_info(client)
    finally:
        if own_client:
            await client.close()
    return Run(sender.records, sender.start, duration, before, after, wall_start, sampler)
