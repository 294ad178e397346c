"""The body every engine-rank actor shares (prefill, decode and normal workers).

One rank = one engine + one `EngineLoop` thread + (for world size > 1) a
`TorchDistCommunicator` to its pool peers, behind a `GroupCommunicator` the engine is
given when it is built (group_member.py forms and re-forms that group), + one KV
endpoint of the cluster's transport (kv_transfer/<backend>/), which this module never
looks inside. A request's life on a rank:

1. The router starts an attempt: `add_request(AddRequest)` (NORMAL / PROMPT) or
   `import_prefilled(payload)` (COMPLETION, decode_worker/, reached through the KV
   endpoint's receive side). Admission runs under the engine lock between steps, then
   wakes this rank and its pool peers (lockstep: peers take empty steps while this rank
   works).
2. Each step's outputs become one typed `StepReport` (`rank/messages.py`); the router
   long-polls them (`poll`), so one Ray reply carries whole steps, never single tokens.
3. A PROMPT rank (prefill_worker/) exports a finished prompt's KV through its endpoint
   and reports a `HandoffTicket`; the payload stays until the router releases it
   (`release_kv`), after the decode rank confirmed the import.
4. The attempt ends on the rank with a finish reason (or `abort` from the router); a
   step that raised ends its attempts with `error` (`step_failed`), and after
   `max_failed_steps` failed steps in a row the rank reports itself `fatal`.

A KV backend's own calls (pair groups, shared-memory imports, direct hand-offs) come in
through `kv_call` and are answered by the endpoint by their type. The `grpc` endpoint
authenticates every transfer with the cluster's `KVSecret`, given to the constructor by
the router through Ray and held by the endpoint only.

Nothing here imports torch at module import time, so the router can reference the
actor classes without pulling torch into its process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.outputs import EngineStats, HandOff, RequestOutput, StepOutputs
from pdserve.kv_transfer import EndpointSizing, make_endpoint
from pdserve.kv_transfer.base import PAYLOAD
from pdserve.rank.group_member import GroupMember, error_text, node_ip
from pdserve.rank.messages import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_MAX_FAILED_STEPS,
    DEFAULT_POLL_TIMEOUT_S,
    AddRequest,
    AdmitResult,
    AttemptKey,
    HandoffTicket,
    ImportResult,
    KVChunkTicket,
    PollReply,
    RankInfo,
    RankTimings,
    StepReport,
    TokenReport,
)
from pdserve.rank.step_timeline import StepTimeline
from pdserve.scheduler.config import DEFAULT_BLOCK_SIZE

log = logging.getLogger(__name__)


def default_engine_factory(config: dict, communicator: Any) -> Any:
    # lazy: engine.engine imports torch; the router imports this module
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(**config), communicator=communicator)


def default_loop_factory(engine: Any, on_step: Callable, communicator: Any,
                         on_error: Callable) -> Any:
    # lazy: engine_loop imports torch; the router imports this module
    from pdserve.engine.engine_loop import EngineLoop

    return EngineLoop(engine, on_step=on_step, communicator=communicator,
                      park_timeout_s=0.5, on_error=on_error)


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def rank_threads(setting: int | str, pool_size: int, cores: int) -> int:
    """The torch threads of a rank of a pool (``PoolConfig.threads``): a number as
    given; "auto", its share of its node's ``cores`` among the pool's ``pool_size``
    ranks, in every pool. A decode step then runs on 1 thread or on these, whichever
    has been faster lately (a decode rank borrows an idle prefill rank's cores); a
    prompt step on all of them, so the pools' threads together may outnumber the cores
    while both compute: measured on 2 cores, 1P+1D, prefill ranks on 2 threads served
    16 streams 1.06-1.32x the tokens a second with a lower TTFT, one stream alike
    (docs/configuration.md, Threads)."""
    if setting != "auto":
        return int(setting)
    return max(1, cores // max(pool_size, 1))


class EngineRank(GroupMember):
    """One rank of a pool; wrapped by the Ray actor classes of the worker packages."""

    pool_name = "normal"
    engine_type = "normal"

    def __init__(self, engine_config: dict, *, engine_factory: Callable | None = None,
                 loop_factory: Callable | None = None,
                 communicator_factory: Callable | None = None,
                 kv_transport: str = "ray",
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
                 threads: int | str | None = None, pool_size: int = 1,
                 max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS,
                 kv_secret: Any = None) -> None:
        """``kv_secret``: the cluster's ``KVSecret`` (the router's, through Ray), which the
        ``grpc`` KV endpoint checks every transfer against; held by the endpoint only."""
        config = dict(engine_config)
        config["engine_type"] = self.engine_type
        self.engine_config = config
        self._engine_factory = engine_factory or default_engine_factory
        self._loop_factory = loop_factory or default_loop_factory
        self.kv_transport = kv_transport
        self.max_failed_steps = max_failed_steps
        if threads is not None:
            # Ray sets OMP_NUM_THREADS=1 in actors; choose torch's threads on purpose.
            import torch  # lazy: only a rank gets here; the router imports this module

            torch.set_num_threads(rank_threads(threads, pool_size, _cores()))
        self._init_group(communicator_factory, collective_timeout_s)
        self.engine = self._engine_factory(config, self.group)
        self._reports: list[StepReport] = []
        self._cond = threading.Condition()
        # One lock for the engine across every loop this rank runs: admission between
        # steps, and also while the group re-forms (no loop then; the next one sees it).
        self._engine_lock = threading.Lock()
        self._loop_error: str | None = None
        self._failed_in_a_row = 0
        self._fatal: str | None = None
        self.timeline = StepTimeline()
        self._last_stats: EngineStats | None = None
        self.endpoint = make_endpoint(kv_transport, self, node_ip(), secret=kv_secret,
                                      sizing=self.endpoint_sizing())
        self.kv_address: str | None = self.endpoint.address
        self.wake_address = ""  # a decode rank's wake channel (decode_worker/)

    def __repr__(self) -> str:  # Ray shows it; nothing secret in it
        # Ray calls it while reporting a failed __init__ too: never raise here.
        pool, rank = getattr(self, "pool_name", "?"), getattr(self, "rank", "?")
        return f"{type(self).__name__}(pool={pool}, rank={rank}, pid={os.getpid()})"

    def endpoint_sizing(self) -> EndpointSizing:
        """What this rank's KV cache allows its endpoint: the longest sequence it could
        import (its KV blocks and the model length) and that sequence's KV bytes; the
        staging memory a sender keeps (``_staging_bytes``); the cache's device."""
        kv = self.engine.kv_capacity()
        return EndpointSizing(staging_bytes=self._staging_bytes(), max_tokens=kv.max_tokens,
                              max_tensor_bytes=kv.max_payload_bytes, device=kv.device)

    def _staging_bytes(self) -> int:
        """Memory a sender keeps for payloads on their way (only a prefill rank sends)."""
        return 0

    # -- identity --------------------------------------------------------------------

    def info(self) -> RankInfo:
        eng = self.engine
        tok = eng.tokenizer
        stats = self.stats()
        node_id = ""
        try:
            import ray  # lazy: ray is heavy; a rank outside Ray (unit tests) has no node

            node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # not inside Ray (unit tests)
            pass
        import torch  # lazy: only a rank gets here; the router imports this module

        capacity = self.engine.kv_capacity()
        device, gpu_uuid = capacity.device, ""
        if device.startswith("cuda"):
            try:
                gpu_uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
            except Exception:  # unknown: the device transport then stays on gloo
                pass
        return RankInfo(
            pool=self.pool_name, engine_type=self.engine_type, pid=os.getpid(), node_id=node_id,
            host=node_ip(), max_model_len=int(eng.max_model_len),
            vocab_size=int(eng.runner.vocab_size or tok.vocab_size),
            eos_token_id=tok.eos_token_id,
            block_size=int(self.engine_config.get("block_size", DEFAULT_BLOCK_SIZE)),
            num_total_blocks=stats.num_total_blocks, kv_address=self.kv_address,
            device=device, gpu_uuid=gpu_uuid, kv_dtype=capacity.dtype,
            threads=torch.get_num_threads(), wake_address=self.wake_address)

    def ping(self) -> int:
        """Answers at once (no engine lock): the controller's liveness check."""
        return os.getpid()

    # -- admission -------------------------------------------------------------------

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        with self._engine_lock:
            result = fn(self.engine)
        self._wake_pool()
        return result

    def add_request(self, request: AddRequest) -> AdmitResult:
        arrival = time.monotonic()  # before waiting for the step in progress to end
        try:
            self._call(lambda eng: eng.add_request(
                request.attempt, list(request.prompt_token_ids), request.sampling,
                arrival_time=arrival, forks=[(f.attempt, f.sampling) for f in request.forks],
                stream_kv=request.stream_kv, moved=request.moved))
        except (ValueError, TypeError, RuntimeError) as exc:
            return AdmitResult(False, error_text(exc))
        return AdmitResult(True)

    def import_prefilled(self, payload: Any, *, borrowed: bool = False,
                         skip_blocks: int = 0) -> ImportResult:
        """A prefilled payload to decode (only a decode rank takes one: decode_worker/)."""
        return ImportResult(False, kind=PAYLOAD,
                            error=f"a {self.engine_type} rank imports no KV payloads")

    def kv_call(self, call: Any, *data: Any) -> Any:
        """One of the KV backend's own calls (kv_transfer/<backend>/calls.py), answered by
        this rank's endpoint; ``data``: arguments Ray resolved for it."""
        return self.endpoint.handle(call, *data)

    def abort(self, attempt: AttemptKey) -> bool:
        self.endpoint.release(attempt)
        return bool(self._call(lambda eng: eng.abort(attempt)))

    # -- reporting -------------------------------------------------------------------

    def _on_step(self, out: StepOutputs) -> None:
        end = time.time()
        self._count_failures(out)
        if not out.outputs and not out.handoffs and not out.cache_events and not out.kv_chunks:
            self.timeline.step(self.pool_name, self.rank, out, end)
            return
        hs = time.time() if out.handoffs else 0.0
        handoffs, kv_chunks = self._export_step(out)
        self.endpoint.forget_unexported()  # what a failed export was lent
        self.timeline.step(self.pool_name, self.rank, out, end, hs, time.time() if hs else 0.0)
        report = StepReport.of(out, handoffs, kv_chunks)
        self._add_timings(out, report.outputs)
        with self._cond:
            self._reports.append(report)
            self._cond.notify_all()

    def _export_step(self, out: StepOutputs) -> tuple[list[HandoffTicket], list[KVChunkTicket]]:
        """The step's hand-offs and KV chunks, exported (only a prefill rank has any)."""
        return [], []

    def _add_timings(self, out: StepOutputs, entries: list[TokenReport]) -> None:
        """Durations on this rank's clock for the router's TTFT breakdown (the worker
        classes say which)."""
        return None

    def _count_failures(self, out: StepOutputs) -> None:
        """A rank whose steps keep failing gives up: it stops stepping and says so."""
        if any(o.step_failed for o in out.outputs):
            self._failed_in_a_row += 1
            if self._failed_in_a_row >= self.max_failed_steps and self._fatal is None:
                self._fatal = (f"{self._failed_in_a_row} steps in a row failed; last: "
                               f"{next(o.error for o in out.outputs if o.step_failed)}")
                log.error("%s rank %d gives up: %s", self.pool_name, self.rank, self._fatal)
                if self.loop is not None:
                    self.loop.stop(timeout=0)
        elif out.num_rows:
            self._failed_in_a_row = 0

    def _on_error(self, exc: BaseException) -> None:
        self._loop_error = self._redact(error_text(exc))
        with self._cond:
            self._cond.notify_all()

    def poll(self, timeout_s: float = DEFAULT_POLL_TIMEOUT_S) -> PollReply:
        """Every step report since the last poll (waits up to `timeout_s` for one)."""
        with self._cond:
            if not self._reports and self._fatal is None:
                self._cond.wait(timeout_s)
            reports, self._reports = self._reports, []
        return PollReply(reports, self._poll_stats(), self.generation,
                         loop_error=self._loop_error or self._fatal, fatal=self._fatal is not None)

    def _poll_stats(self) -> EngineStats:
        """Fresh stats when the engine is between steps, else the latest ones: a poll
        must not wait for a running step, or the reports it carries (first tokens among
        them) wait with it."""
        if self._last_stats is not None and not self._engine_lock.acquire(blocking=False):
            return self._last_stats
        if self._last_stats is None:
            return self.stats()
        try:
            st = self.engine.stats()
        finally:
            self._engine_lock.release()
        return self._stats(st)

    def stats(self) -> EngineStats:
        with self._engine_lock:
            st = self.engine.stats()
        return self._stats(st)

    def _stats(self, st: EngineStats) -> EngineStats:
        """The engine's stats with the rank's own fields set."""
        stats = dataclasses.replace(st, rank=self.rank,
                                    num_woken_imports=int(self.endpoint.num_woken))
        self._last_stats = stats
        return stats

    def timeline_records(self, since: float = 0.0, since_seq: int = 0) -> list[dict]:
        """This rank's recent steps (a bounded ring; see step_timeline.py)."""
        return self.timeline.since(since, since_seq)

    def is_idle(self) -> bool:
        with self._engine_lock:
            return not self.engine.has_work() and len(self.endpoint) == 0

    def check_drained(self) -> str | None:
        """None when the engine holds nothing (the engine's block-leak invariant) and no
        exported payload waits for release."""
        with self._engine_lock:
            if len(self.endpoint):
                return f"{self.pool_name} rank {self.rank}: {len(self.endpoint)} KV payloads held"
            if not hasattr(self.engine, "assert_drained"):
                return None
            try:
                self.engine.assert_drained()
            except AssertionError as exc:
                return f"{self.pool_name} rank {self.rank}: {exc}"
        return None

    # -- exported payloads -------------------------------------------------------------

    def release_kv(self, attempt: str) -> None:
        self.endpoint.release(attempt)

    def release_kv_many(self, attempts: list[str]) -> None:
        for attempt in attempts:
            self.endpoint.release(attempt)

    def shutdown(self) -> None:
        self.pause(timeout_s=2.0)
        self.endpoint.close()
        self.engine.guided.close()  # its compile thread
        self._close_group()


def prefill_timings(x: RequestOutput | HandOff) -> RankTimings | None:
    """Prefill queue and compute, in seconds, from a RequestOutput's or HandOff's
    engine-clock times (None when the engine did not record them)."""
    if x.first_scheduled_time is None or x.first_token_time is None:
        return None
    return RankTimings(prefill_queue_s=max(0.0, x.first_scheduled_time - x.arrival_time),
                       prefill_s=max(0.0, x.first_token_time - x.first_scheduled_time))


def add_timings(out: StepOutputs, entries: list[TokenReport],
                imported_at: dict[str, float]) -> None:
    """Durations on this rank's clock for the router's TTFT breakdown: a decode rank's
    wait from taking a payload (``imported_at``: attempt -> monotonic time, consumed) to
    its first decode step; a rank's prefill queue and prefill, on the output that carries
    the first token."""
    step_start = time.monotonic() - out.duration_s
    for o, entry in zip(out.outputs, entries, strict=True):
        taken = imported_at.pop(o.attempt, None) if imported_at else None
        if taken is not None:
            entry.timings = RankTimings(
                decode_queue_s=max(0.0, step_start - taken),
                kv_imported_wall=time.time() - (time.monotonic() - taken))
        elif o.new_token_ids and o.num_output_tokens == len(o.new_token_ids):
            entry.timings = prefill_timings(o)
