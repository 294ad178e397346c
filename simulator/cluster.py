"""The simulated cluster: the router's side of a request's life on virtual time.

A request arrives (``workload``), the router picks a prefill rank (``routing``) and
queues it there; the prefill pool's step that completes its prompt streams the first
token at the step's end and hands the KV off: the router picks a decode rank, and the
payload arrives ``handoff.seconds(bytes)`` later (with KV streaming only the last
step's blocks are left to send: the earlier ones went while the prompt computed). The
decode rank imports it when its blocks are free and decodes; each decode step's end is
a token on the client's stream. In normal mode one pool does both.

Not modelled: the router's own queueing and its gRPC/Ray call latencies (beyond the
hand-off's fixed cost), step-report lag of the router's view of free blocks and
caches, a decode rank taking a cached prefix of an import instead of allocating it,
request moves after failures, forks (n > 1), aborts, and the chunk streams choosing
their decode rank at the first chunk (here: at the hand-off).
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from pdserve.bench.serve_metrics import RequestRecord
from pdserve.engine.config import EngineConfig, EngineSettings
from pdserve.router import routing
from pdserve.router.config import ROUTINGS
from pdserve.router.routing import PromptBlocks
from pdserve.scheduler.config import EngineType, SchedulerConfig
from pdserve.scheduler.output import SchedulerOutput, StepResult
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.simulator.client_log import ClientLog
from pdserve.simulator.clock import Clock
from pdserve.simulator.collector import collector_paused
from pdserve.simulator.cost_model import CostModel
from pdserve.simulator.pool import SimPool
from pdserve.simulator.rank import SimRank, SimSequence
from pdserve.simulator.routing import DecodeRouter, PrefillRouter
from pdserve.simulator.workload import WorkItem, Workload

RING_LEN = 134  # the spec's default ring length (no sliding-window model is simulated)


@dataclass
class SimConfig:
    mode: str = "disaggregated"  # or "normal"
    prefill: int = 1
    decode: int = 1
    replicas: int = 1  # normal mode's ranks
    # Every rank's engine settings (engine/config.py, as a serve config's `engine:`;
    # a mapping is typed at construction): the engine's defaults apply to the rest.
    engine: EngineSettings = field(default_factory=EngineSettings)
    routing: str = "cache_aware"
    prefix_overlap_weight: float = 2.0
    kv_streaming: bool = True
    max_concurrency: int | None = None
    record_steps: bool = False  # keep every rank step (for timelines and tests)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineSettings):
            self.engine = EngineSettings.from_mapping(self.engine or {}, "engine")
        if self.mode not in ("disaggregated", "normal"):
            raise ValueError(f"mode must be disaggregated or normal, got {self.mode!r}")
        for name in (("prefill", "decode") if self.mode == "disaggregated" else ("replicas",)):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.routing not in routing_names():
            raise ValueError(f"routing must be one of {routing_names()}, got {self.routing!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")

    def scheduler_config(self, engine_type: str, costs: CostModel) -> SchedulerConfig:
        """What ``LLMEngine`` would give its scheduler with these settings."""
        engine = EngineConfig(model_dir="", engine_type=engine_type, **self.engine.settings())
        max_len = engine.max_model_len or costs.max_model_len
        blocks = engine.resolve_num_kv_blocks(costs.kv_bytes_per_token * engine.block_size)
        return engine.scheduler_config(num_blocks=blocks, max_model_len=max_len,
                                       ring_len=RING_LEN)


def routing_names() -> tuple[str, ...]:
    return ROUTINGS


@dataclass
class SimResult:
    log: ClientLog  # what the clients saw
    duration: float
    stats: dict
    steps: list[tuple] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.log)

    @cached_property
    def records(self) -> list[RequestRecord]:
        """The clients' records as bench serve keeps them (built on first use)."""
        return self.log.records()


class _Request:
    """The router's state of one request (what ``RequestState`` keeps that we need)."""

    __slots__ = ("item", "index", "attempt", "outstanding", "pending", "hashes", "rank")

    def __init__(self, item: WorkItem, index: int) -> None:
        self.item = item
        self.index = index  # in the client log
        self.attempt = str(index)
        self.outstanding = 0
        self.pending: list[bytes] = []
        self.hashes: list[bytes] = []
        self.rank: SimRank | None = None


class Cluster:
    def __init__(self, config: SimConfig, costs: CostModel) -> None:
        self.config = config
        self.costs = costs
        self.clock = Clock()
        self.requests: dict[str, _Request] = {}
        if config.mode == "disaggregated":
            pc = config.scheduler_config("prompt", costs)
            dc = config.scheduler_config("completion", costs)
            self.entry = SimPool("prefill", config.prefill, pc, EngineType.PROMPT, costs,
                                 self.clock, self._on_step)
            self.decode: SimPool | None = SimPool(
                "decode", config.decode, dc, EngineType.COMPLETION, costs, self.clock,
                self._on_step, first_uid=config.prefill)
            self.decode_router: DecodeRouter | None = DecodeRouter(self.decode.ranks)
            # the router sees free blocks as they are now: a preemption's are free at once
            self.decode.on_preempted = self.decode_router.index.touch
        else:
            nc = config.scheduler_config("normal", costs)
            self.entry = SimPool("normal", config.replicas, nc, EngineType.NORMAL, costs,
                                 self.clock, self._on_step)
            self.decode = None
            self.decode_router = None
        self.block_size = self.entry.ranks[0].scheduler.config.block_size
        self.caching = self.entry.ranks[0].scheduler.caching
        self.prefill_router = PrefillRouter(self.entry.ranks, config.routing,
                                            config.prefix_overlap_weight)
        if config.record_steps:
            for pool in self.pools:
                pool.step_log = []
        self.log = ClientLog()
        self.num_done = 0
        self._in_flight = 0
        self._held: deque[_Request] = deque()  # over max_concurrency, in arrival order
        self._after: dict[int, list[_Request]] = {}  # waiting for an earlier request to end
        self._done: set[int] = set()  # indices that ended (for `after`)
        self._sampling_of: dict[int, SamplingParams] = {}

    @property
    def pools(self) -> list[SimPool]:
        return [self.entry] + ([self.decode] if self.decode is not None else [])

    # -- clients ---------------------------------------------------------------------

    def run(self, workload: Workload, progress: bool = False, tick_s: float = 60.0) -> SimResult:
        items = iter(workload)
        self.log = log = ClientLog()
        self._total = workload.num_requests
        wall = time.perf_counter()

        def next_arrival() -> None:
            item = next(items, None)
            if item is not None:
                self.clock.at(item.arrival_s, arrive, item)

        def arrive(item: WorkItem) -> None:
            req = _Request(item, log.open(len(item.prompt), item.output_len, item.kind,
                                          item.arrival_s))
            if item.after is not None and item.after not in self._done:
                self._after.setdefault(item.after, []).append(req)
            else:
                self._send(req)
            next_arrival()

        def tick(now: float) -> None:
            print(f"simulate: t={now:,.0f}s virtual, {self.num_done:,}/{self._total:,} done, "
                  f"{time.perf_counter() - wall:,.1f}s wall, {self.clock.num_events:,} events",
                  file=sys.stderr, flush=True)

        next_arrival()
        with collector_paused():
            self.clock.run(on_tick=tick if progress else None, tick_s=tick_s)
        return SimResult(log, log.duration() or 1e-9, self._stats(time.perf_counter() - wall),
                         [s for p in self.pools for s in p.step_log] if self.config.record_steps
                         else None)

    def _send(self, req: _Request) -> None:
        cap = self.config.max_concurrency
        if cap is not None and self._in_flight >= cap:
            self._held.append(req)
            return
        self._in_flight += 1
        self.log.send_time[req.index] = self.clock.now
        self._dispatch(req)

    def _ended(self, req: _Request, reason: str, now: float) -> None:
        log = self.log
        log.end(req.index, reason, now)
        self.requests.pop(req.attempt, None)
        self.num_done += 1
        self._in_flight -= 1
        self._done.add(req.item.index)
        for waiter in self._after.pop(req.item.index, ()):
            log.scheduled_time[waiter.index] = max(log.scheduled_time[waiter.index], now)
            self._send(waiter)
        if self._held:
            self._send(self._held.popleft())

    # -- the router ------------------------------------------------------------------

    def _dispatch(self, req: _Request) -> None:
        item = req.item
        rid = req.attempt
        prompt = (PromptBlocks.of(item.prompt, self.block_size)
                  if self.config.routing == "cache_aware"
                  else PromptBlocks(len(item.prompt), self.block_size, []))
        rank = self.prefill_router.choose(prompt)
        seq = SimSequence(rid, item.prompt, self._sampling(item.output_len),
                          arrival_time=self.clock.now)
        seq.client = req.index
        if prompt.hashes:  # the router's names of its blocks are the scheduler's (prefix_hash)
            seq.block_hashes = list(prompt.hashes)
        req.rank = rank
        req.outstanding = len(item.prompt) - prompt.cached_tokens
        req.pending = req.hashes = prompt.hashes
        # Its key only gets worse here (no touch needed: see IndexedChooser.touch).
        rank.outstanding_tokens += req.outstanding
        rank.inflight.add(rid)
        routing.add_pending(rank.pending_blocks, prompt.hashes)
        self.requests[rid] = req
        rank.inbox.append(seq)
        self.entry.wake(rank)

    def _sampling(self, output_len: int) -> SamplingParams:
        """Requests of one output length share their sampling params (frozen): one
        object for all of them, not one per request, to create and to keep."""
        params = self._sampling_of.get(output_len)
        if params is None:
            params = SamplingParams(max_tokens=output_len, ignore_eos=True)
            self._sampling_of[output_len] = params
        return params

    def _leave_entry(self, req: _Request) -> None:
        """The request leaves its entry rank (``RouterService._leave``): handed off, or
        ended; in normal mode only its end does (as in the router, its prompt tokens
        count in the rank's queue until then)."""
        rank = req.rank
        if rank is None or req.attempt not in rank.inflight:
            return
        rank.inflight.discard(req.attempt)
        rank.outstanding_tokens = max(0, rank.outstanding_tokens - req.outstanding)
        if req.pending:
            routing.drop_pending(rank.pending_blocks, req.pending)
            req.pending = []
        self.prefill_router.index.touch(rank)

    def _on_step(self, pool: SimPool, rank: SimRank, out: SchedulerOutput,
                 result: StepResult, now: float) -> None:
        self.log.stream(now, result.updated)
        requests = self.requests
        entry = pool is self.entry
        for seq in result.finished:
            req = requests.get(seq.attempt)
            if req is None:
                continue
            if entry:
                self._leave_entry(req)
            elif req.rank is not None:
                req.rank.inflight.discard(seq.attempt)
            self._ended(req, seq.finish_reason or "error", now)
        if result.handed_off:
            self._hand_off(out, result, now)
        if not entry:
            self.decode_router.index.touch(rank)  # its free blocks changed

    def _hand_off(self, out: SchedulerOutput, result: StepResult, now: float) -> None:
        bs = self.block_size
        started = {row.attempt: row.start_pos for row in out.scheduled}
        for seq in result.handed_off:
            req = self.requests[seq.attempt]
            self._leave_entry(req)
            streamed = started[seq.attempt] // bs if self.config.kv_streaming else 0
            hashes = req.hashes if (self.config.routing == "cache_aware" and not streamed) else []
            dst = self.decode_router.choose(hashes)
            if not dst.can_import(seq.prompt_len):
                self._ended(req, "error", now)
                continue
            skip = dst.cached_prefix_blocks(hashes) if hashes else 0
            sent = max(0, seq.prompt_len - max(streamed, skip) * bs)
            # Its key only gets worse here (no touch needed: see IndexedChooser.touch).
            dst.pending_imports += 1
            dst.inflight.add(seq.attempt)
            req.rank = dst
            copy = SimSequence(seq.attempt, seq.token_ids[:seq.prompt_len], seq.sampling,
                               arrival_time=seq.arrival_time)
            copy.processed = seq.prompt_len
            # The names of its prompt's full blocks are a function of their tokens: the
            # decode rank would compute the same ones again when it registers the import.
            copy.block_hashes = seq.block_hashes[:seq.prompt_len // bs]
            copy.client = seq.client
            self.clock.at(now + self.costs.handoff.seconds(sent * self.costs.kv_bytes_per_token),
                          self._arrive, dst, copy)

    def _arrive(self, dst: SimRank, seq: SimSequence) -> None:
        dst.pending_imports -= 1
        dst.imports.append(seq)
        self.decode_router.index.touch(dst)
        self.decode.wake(dst)

    # -- what the run did ----------------------------------------------------------------

    def _stats(self, wall_s: float) -> dict:
        pools = {}
        for pool in self.pools:
            ranks = pool.ranks
            pools[pool.name] = {
                "ranks": len(ranks),
                "pool_steps": pool.num_steps,
                "rank_steps": sum(r.num_steps for r in ranks),
                "empty_rank_steps": sum(r.num_empty_steps for r in ranks),
                "preemptions": sum(r.scheduler.num_preemptions for r in ranks),
            }
        return {"pools": pools, "wall_s": wall_s, "events": self.clock.num_events,
                "virtual_s": self.clock.now,
                "requests_per_wall_s": len(self.log) / wall_s if wall_s > 0 else math.inf}
