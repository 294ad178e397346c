"""The router, independent of gRPC (server.py and http_api.py adapt it): a facade over
the parts that each do one job.

Disaggregated: validate -> tokenize -> least-loaded prefill rank -> first token
streamed at once -> KV payload handed to the decode rank with the most free blocks
-> each decode step's tokens fanned out to the client streams. Normal: one pool of
NORMAL ranks does both phases. Every request ends with exactly one finish event;
an abort (client gone, deadline, `Abort`) reaches the request wherever it is.

The parts: ``RequestFlow`` (request_flow.py: admission, dispatch, moves, ends; where
an attempt runs is changed only through placement.py), ``RankMonitor``
(rank_monitor.py: polling, dead ranks, healing), ``ReportRouter`` (report_routing.py:
each step report to its requests, each hand-off's task), ``HandoffDelivery``
(handoff.py: a payload to a decode rank), ``KVStreams`` (kv_stream.py: KV streamed
ahead), status.py (what the router shows), the pools (pools.py) and the planner
(planner/, through its ``PlannerHost`` interface, which this class is).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from pdserve.engine.model.tokenizer import Tokenizer  # tokenizers only; no torch
from pdserve.kv_transfer import KVSecret, make_transport
from pdserve.planner.latency_window import RecentLatencies
from pdserve.planner.loop import PlannerLoop  # drives this (a PlannerHost)
from pdserve.router import status
from pdserve.router.chat_template import ChatTemplate
from pdserve.router.config import RouterConfig
from pdserve.router.handoff import HandoffDelivery
from pdserve.router.kv_stream import KVStreams
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import abort_on
from pdserve.router.pools import Pool
from pdserve.router.rank_monitor import RankMonitor
from pdserve.router.report_routing import ReportRouter
from pdserve.router.request_error import RequestError
from pdserve.router.request_flow import RequestFlow
from pdserve.router.requests import RequestState, RequestTracker
from pdserve.router.validation import ModelLimits, PreparedRequest

log = logging.getLogger(__name__)


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        config.validate()
        config.check_kv_dtypes()  # the pools' devices are decided by now
        if config.kv_transport == "auto":  # decided once, here: the ranks get the result
            resolved = config.resolved_kv_transport()
            log.info("kv_transport auto: %s (prefill num_gpus %g, decode num_gpus %g)",
                     resolved, config.prefill.num_gpus, config.decode.num_gpus)
            config = dataclasses.replace(config, kv_transport=resolved)
        self.config = config
        self.tracker = RequestTracker(config.max_queue_depth)
        # The cluster's KV key: the grpc transport authorizes every transfer with it; it
        # reaches the ranks only as an actor argument (Pool._new_actor), never a file,
        # the environment or a log (KVSecret's repr hides it).
        self._kv_secret = KVSecret.generate() if config.kv_transport == "grpc" else None
        self.transport = make_transport(config.kv_transport, secret=self._kv_secret,
                                        timeout_s=config.handoff_timeout_s)
        self.pools: dict[str, Pool] = {p.name: Pool(p, config, kv_secret=self._kv_secret)
                                       for p in config.pools()}
        self.tokenizer: Any = None
        self.chat_template: Any = None  # the model's (ChatTemplate), None when it has none
        self.limits: ModelLimits | None = None
        # Recent TTFT and inter-token samples by rank: the planner's, and status'.
        self.latencies = RecentLatencies(config.planner_window_s)
        self.planner = None  # the SLO planner's loop (planner/loop.py), with autoscale
        self.metrics = RouterMetrics(self)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._wire_parts()

    def _wire_parts(self) -> None:
        """The parts, each given what it uses (see the module docstring)."""
        config, spawn = self.config, self.spawn
        stopping = lambda: self._stopping  # noqa: E731
        abort = functools.partial(abort_on, timeout_s=config.rank_call_timeout_s)
        self.kv_streams = KVStreams(config, lambda: self.pools["decode"], self.transport,
                                    spawn=spawn, abort_on=abort)
        self.flow = RequestFlow(config, self.tracker, self.pools, self.kv_streams, spawn=spawn,
                                abort_on=abort, stopping=stopping)
        self.handoffs = HandoffDelivery(config, self.pools, self.transport, self.metrics,
                                        self.kv_streams.streams, spawn=spawn,
                                        move=self.flow.move, finish=self.flow.finish,
                                        abort_on=abort)
        self.kv_streams.handoffs = self.handoffs
        self.reports = ReportRouter(self.tracker, self.transport, self.flow, self.kv_streams,
                                    self.handoffs, spawn=spawn, abort_on=abort,
                                    stopping=stopping)
        self.monitor = RankMonitor(config, self.tracker, self.flow, self.reports, spawn=spawn,
                                   stopping=stopping)
        for pool in self.pools.values():
            pool.on_new_rank = self.monitor.start_polling
            pool.on_rank_removed = self.monitor.requests_left_on

    # -- counters (metrics, status, tests) -------------------------------------------

    @property
    def num_moves(self) -> int:
        return self.flow.num_moves

    @property
    def num_rank_failures(self) -> int:
        return self.monitor.num_rank_failures

    @property
    def num_lost_reports(self) -> int:
        return self.reports.num_lost_reports

    @property
    def num_early_reports(self) -> int:
        """Decode reports held until their hand-off's ticket came."""
        return self.reports.num_early_reports

    @property
    def num_handoffs_in_flight(self) -> int:
        return self.reports.num_handoffs_in_flight

    @property
    def num_kv_chunks_streamed(self) -> int:
        """Chunks that reached a decode rank ahead of their hand-off."""
        return self.kv_streams.num_chunks_streamed

    @property
    def num_kv_streams(self) -> int:
        """Requests whose KV is being streamed ahead of their hand-off."""
        return len(self.kv_streams.streams)

    @property
    def num_kv_blocks_skipped(self) -> int:
        """KV blocks a decode rank's cache held: not sent."""
        return self.handoffs.num_kv_blocks_skipped

    @property
    def num_direct_handoffs(self) -> int:
        """Hand-offs a prefill rank had its decode rank import."""
        return self.handoffs.num_direct_handoffs

    @property
    def num_direct_refused(self) -> int:
        """Direct hand-offs the decode rank refused (then the router delivered them)."""
        return self.handoffs.num_direct_refused

    @property
    def num_direct_local(self) -> int:
        """Direct hand-offs whose answer came through the wake channel, not Ray."""
        return getattr(self.transport, "num_direct_local", 0)

    @property
    def block_size(self) -> int:
        return self.flow.block_size

    @property
    def disaggregated(self) -> bool:
        return self.config.mode == "disaggregated"

    @property
    def entry_pool(self) -> Pool:
        return self.flow.entry_pool

    # -- start / stop ----------------------------------------------------------------

    async def start(self) -> None:
        self.tokenizer = Tokenizer.from_model(self.config.model_dir)
        self.chat_template = ChatTemplate.from_model_dir(self.config.model_dir)
        await asyncio.gather(*(p.start() for p in self.pools.values()))
        infos = [r.info for p in self.pools.values() for r in p.ranks]
        try:
            self.flow.block_size = self._agreed_layout()
        except RuntimeError:  # nothing could be served: the ranks go with the error
            await self.stop()
            raise
        max_len = min(i.max_model_len for i in infos)
        vocab = min(i.vocab_size for i in infos)
        self.flow.max_model_len = max_len
        limit = self.config.max_tokens_limit or max_len - 1
        self.limits = ModelLimits(vocab_size=vocab, max_model_len=max_len, max_tokens_limit=limit,
                                  max_choices=self.config.max_choices)
        self.spawn(self.flow.watch_stalls())
        if self.config.autoscale:
            self.planner = PlannerLoop(self)
            self.spawn(self.planner.run())

    def _agreed_layout(self) -> int:
        """The block size every rank's KV cache has; RuntimeError when the ranks disagree
        on it or (disaggregated) on what their blocks hold: a decode rank imports a prefill
        rank's blocks as they are. The pools' settings were checked before any rank
        started (``RouterConfig``), but a dtype also follows the model file and the device
        (``kv_precision`` auto: fp16 on the CPU where the file's blocks make the
        activations int8; on a GPU the model's dtype), which only the ranks know."""
        infos = {name: [r.info for r in p.ranks] for name, p in self.pools.items()}
        block_sizes = {i.block_size for pool in infos.values() for i in pool}
        if len(block_sizes) != 1:
            raise RuntimeError(f"ranks disagree on block_size: {sorted(block_sizes)}")
        held = {name: sorted({i.kv_dtype for i in pool}) for name, pool in infos.items()}
        if self.disaggregated and len({d for kinds in held.values() for d in kinds}) > 1:
            said = " and ".join(f"the {name} ranks' {' / '.join(kinds)} (on "
                                f"{', '.join(sorted({i.device for i in infos[name]}))})"
                                for name, kinds in held.items())
            raise RuntimeError(
                f"the KV caches hold different dtypes: {said}; a decode rank imports the "
                f"prefill ranks' KV blocks as they are, so every hand-off would be refused. "
                f"Give both pools one device, or set engine.dtype and engine.kv_precision "
                f"so that both caches hold one dtype")
        return block_sizes.pop()

    async def stop(self) -> None:
        self._stopping = True
        for state in self.tracker.states():
            state.finish("abort", "the router is shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(p.stop() for p in self.pools.values()), return_exceptions=True)
        await self.transport.close()

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` as one of the router's tasks: kept until done, cancelled at stop
        (the planner's resizes run here too: planner/host.py)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- requests (request_flow.py) --------------------------------------------------

    def admit(self, request: PreparedRequest, client_gone: Callable[[], bool] | None = None,
              tenant: str = "") -> list[RequestState]:
        """Register a validated request and send it (``RequestFlow.admit``)."""
        return self.flow.admit(request, client_gone, tenant)

    async def abort(self, label: str, reason: str = "aborted by the client",
                    tenant: str = "") -> bool:
        """End ``tenant``'s request in flight under ``label`` (only that one) with "abort"."""
        return await self.flow.abort(label, reason, tenant)

    async def end(self, state: RequestState, reason: str) -> None:
        """End a request with "abort" wherever it is (client gone, deadline, Abort)."""
        await asyncio.gather(*self.flow.end_now(state, reason))

    def end_now(self, state: RequestState, reason: str,
                finish_reason: str = "abort") -> list[asyncio.Task]:
        """``RequestFlow.end_now``: finished before this returns; the aborts on its
        ranks run in the returned tasks."""
        return self.flow.end_now(state, reason, finish_reason)

    # -- state (status.py) -----------------------------------------------------------

    def cluster_state(self) -> dict:
        return status.cluster_state(self)

    def planner_state(self) -> dict:
        return status.planner_state(self)

    async def timeline(self, since: float = 0.0) -> list[dict]:
        """Every live rank's step records that ended after unix time `since`."""
        return await status.timeline(self.pools, since, self.config.rank_call_timeout_s)

    async def refresh_stats(self) -> None:
        """Fresh stats from every live rank (each call bounded)."""
        await status.refresh_stats(self.pools, self.config.rank_call_timeout_s)

    async def scale(self, pool_name: str, replicas: int) -> int:
        """Resize a pool: a pool operation that completes or rolls back on its own,
        whatever the caller does (the caller only waits for it). A second one while one
        runs is refused (FAILED_PRECONDITION)."""
        pool = self.pools.get(pool_name)
        if pool is None:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pool must be one of {sorted(self.pools)}, got {pool_name!r}")
        limit = self.config.max_replicas
        if not 1 <= replicas <= limit:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"replicas must be in [1, {limit}] (max_replicas), got {replicas}")
        if pool.scaling is not None and not pool.scaling.done():
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the {pool_name} pool is already being resized to "
                               f"{pool.target} ranks; retry when it is done")
        pool.scaling = self.spawn(pool.scale(replicas))
        return await asyncio.shield(pool.scaling)
