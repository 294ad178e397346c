"""The router's request flow, independent of gRPC (server.py adapts it).

Disaggregated: validate -> tokenize -> least-loaded prefill rank -> first token
streamed at once -> KV payload handed to the decode rank with the most free blocks
-> each decode step's tokens fanned out to the client streams. Normal: one pool of
NORMAL ranks does both phases. Every request ends with exactly one finish event;
an abort (client gone, deadline, `Abort`) reaches the request wherever it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import ray
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pools import DEAD, Pool, RankHandle
from pdserve.router.requests import DECODE, HANDOFF, PREFILL, RequestState, RequestTracker
from pdserve.router.transports import DeliveryResult, make_transport
from pdserve.router.validation import ModelLimits, PreparedRequest, RequestError

log = logging.getLogger(__name__)


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        config.validate()
        self.config = config
        self.tracker = RequestTracker(config.max_queue_depth)
        self.transport = make_transport(config.kv_transport)
        self.pools: dict[str, Pool] = {p.name: Pool(p, config) for p in config.pools()}
        for pool in self.pools.values():
            pool.on_new_rank = self._start_polling
            pool.on_rank_removed = self._requests_left_on
        self.tokenizer: Any = None
        self.limits: ModelLimits | None = None
        self.num_rank_failures = 0
        self.metrics = RouterMetrics(self)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False

    @property
    def disaggregated(self) -> bool:
        return self.config.mode == "disaggregated"

    @property
    def entry_pool(self) -> Pool:
        return self.pools["prefill" if self.disaggregated else "normal"]

    # -- start / stop ----------------------------------------------------------------

    async def start(self) -> None:
        from pdserve.engine.tokenizer import Tokenizer  # tokenizers only; no torch

        self.tokenizer = Tokenizer.from_dir(self.config.model_dir)
        await asyncio.gather(*(p.start() for p in self.pools.values()))
        infos = [r.info for p in self.pools.values() for r in p.ranks]
        max_len = min(i["max_model_len"] for i in infos)
        vocab = min(i["vocab_size"] for i in infos)
        block_sizes = {i["block_size"] for i in infos}
        if len(block_sizes) != 1:
            raise RuntimeError(f"ranks disagree on block_size: {sorted(block_sizes)}")
        limit = self.config.max_tokens_limit or max_len - 1
        self.limits = ModelLimits(vocab_size=vocab, max_model_len=max_len, max_tokens_limit=limit)

    async def stop(self) -> None:
        self._stopping = True
        for state in self.tracker.states():
            state.finish("abort", "the router is shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(p.stop() for p in self.pools.values()), return_exceptions=True)
        await self.transport.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- requests --------------------------------------------------------------------

    def admit(self, request: PreparedRequest) -> RequestState:
        """Register a validated request (ALREADY_EXISTS / RESOURCE_EXHAUSTED) and send it;
        one whose id an ``Abort`` named before it arrived ends at once with "abort"."""
        state = self.tracker.register(request)
        if self.tracker.take_early_abort(state.request_id):
            state.aborted = True
            self._finish(state, "abort", "aborted by the client before the request arrived")
            return state
        self._spawn(self._dispatch(state))
        return state

    async def _dispatch(self, state: RequestState) -> None:
        pool = self.entry_pool
        rid = state.request_id
        while not (state.finished or state.aborted):
            if state.attempts >= self.config.max_attempts:
                self._finish(state, "error", f"no {pool.name} rank could take the request "
                             f"after {state.attempts} attempts")
                return
            rank = await pool.wait_for_rank(self.config.rank_wait_s)
            if rank is None:
                self._finish(state, "error", f"no {pool.name} rank is available")
                return
            if state.finished or state.aborted:
                return
            state.stage = PREFILL if self.disaggregated else DECODE
            state.prefill_rank = rank if self.disaggregated else None
            state.decode_rank = None if self.disaggregated else rank
            state.attempt_tokens = 0
            rank.inflight.add(rid)
            rank.outstanding_tokens += len(state.request.prompt_token_ids)
            state.attempts += 1
            if state.dispatched_at is None:
                state.dispatched_at = time.monotonic()
                state.timings["router_queue_s"] = state.dispatched_at - state.created
            try:
                result = await rank.actor.add_request.remote(
                    rid, state.request.prompt_token_ids, state.request.sampling_dict())
            except Exception as exc:  # the rank died on the way: try another
                if rid not in rank.inflight:
                    return  # _rank_died got there first and has already re-dispatched it
                self._leave(rank, state)
                log.warning("add_request on %s failed: %s", rank.name, exc)
                continue
            if not result["ok"]:
                self._leave(rank, state)
                self._finish(state, "error", f"{pool.name} rank refused the request: {result['error']}")
                return
            if state.aborted:  # aborted while add_request was on its way
                await self._abort_on(rank, rid)
            return

    def _recover(self, state: RequestState, why: str) -> None:
        """Start the request again on a surviving rank, or end it naming the cause."""
        if state.finished:
            return
        self._leave(state.prefill_rank, state)
        self._leave(state.decode_rank, state)
        if not state.replayable:
            self._finish(state, "error", f"{why}; the request is sampled without a seed, so "
                         "it cannot be recomputed to the same tokens")
            return
        state.prefill_rank = state.decode_rank = None
        self._spawn(self._dispatch(state))

    def _leave(self, rank: RankHandle | None, state: RequestState) -> None:
        if rank is None:
            return
        if state.request_id in rank.inflight:
            rank.inflight.discard(state.request_id)
            if rank.pool in ("prefill", "normal"):
                rank.outstanding_tokens = max(
                    0, rank.outstanding_tokens - len(state.request.prompt_token_ids))

    def _finish(self, state: RequestState, reason: str, error: str | None = None,
                token_ids: list[int] | None = None) -> None:
        state.finish(reason, error, token_ids)
        self._leave(state.prefill_rank, state)
        self._leave(state.decode_rank, state)

    async def _abort_on(self, rank: RankHandle, rid: str) -> None:
        try:
            await rank.actor.abort.remote(rid)
        except Exception:  # a dead rank holds nothing
            pass

    async def abort(self, request_id: str, reason: str = "aborted by the client") -> bool:
        state = self.tracker.get(request_id)
        if state is None:  # not here (yet): a Generate with this id may be on its way
            self.tracker.remember_early_abort(request_id)
            return False
        if state.finished:
            return True
        state.aborted = True
        stage = state.stage
        prefill_rank, decode_rank = state.prefill_rank, state.decode_rank
        self._finish(state, "abort", reason)
        if stage == PREFILL and prefill_rank is not None:
            await self._abort_on(prefill_rank, request_id)
        elif stage == DECODE and decode_rank is not None:
            await self._abort_on(decode_rank, request_id)
        # HANDOFF: the delivery task sees `aborted` and cleans up after itself.
        return True

    # -- rank reports ----------------------------------------------------------------

    def _start_polling(self, pool: Pool, rank: RankHandle) -> None:
        rank.poll_task = self._spawn(self._poll(pool, rank))

    async def _poll(self, pool: Pool, rank: RankHandle) -> None:
        while not self._stopping and rank.state != DEAD:
            try:
                reply = await asyncio.wait_for(
                    rank.actor.poll.remote(self.config.poll_timeout_s),
                    self.config.rank_unresponsive_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    exc = TimeoutError(f"no reply to a poll for {self.config.rank_unresponsive_s:g}s")
                if rank.state != DEAD:
                    await self._rank_died(pool, rank, f"{type(exc).__name__}: {exc}")
                return
            rank.stats = reply["stats"]
            for step in reply["steps"]:
                self._on_step(pool, rank, step)
            if reply["loop_error"] and reply["generation"] == pool.generation:
                rank.error = reply["loop_error"]
                if not pool.lock.locked():
                    log.warning("%s: engine loop failed (%s); re-forming the group",
                                rank.name, reply["loop_error"])
                    self._spawn(pool.heal(reply["generation"]))

    def _requests_left_on(self, pool: Pool, rank: RankHandle, why: str) -> None:
        for rid in list(rank.inflight):
            rank.inflight.discard(rid)
            state = self.tracker.get(rid)
            if state is not None and not state.finished and state.stage != HANDOFF:
                self._recover(state, why)

    def _on_step(self, pool: Pool, rank: RankHandle, step: dict) -> None:
        try:
            self._route_step(rank, step)
        except Exception:  # a bug here must not stop the rank's reports
            log.exception("handling a step report of %s failed", rank.name)

    def _route_step(self, rank: RankHandle, step: dict) -> None:
        for out in step["outputs"]:
            state = self.tracker.get(out["request_id"])
            if state is None or state.finished:
                continue
            if "timings" in out:
                state.timings.update(out["timings"])
            if out["finish_reason"] is not None:
                self._finish(state, out["finish_reason"], out.get("error"), out["token_ids"])
            else:
                state.push(out["token_ids"])
        for handoff in step.get("handoffs", ()):
            state = self.tracker.get(handoff["request_id"])
            if state is None or state.finished or state.aborted:
                self._spawn(self.transport.discard(handoff["ticket"], rank))
                continue
            state.timings.update(handoff.get("timings") or {})
            state.timings["kv_bytes"] = handoff["nbytes"]
            if state.attempt_tokens == 0:
                state.push([handoff["first_token_id"]])  # streamed before any KV moves
            self._leave(rank, state)
            state.stage = HANDOFF
            self._spawn(self._hand_off(state, rank, handoff))

    async def _hand_off(self, state: RequestState, src: RankHandle, handoff: dict) -> None:
        rid = state.request_id
        tried: set[int] = set()
        last_error = ""
        pool = self.pools["decode"]
        started = time.monotonic()
        while True:
            dst = await pool.wait_for_decode(tried, self.config.rank_wait_s)
            if state.finished or state.aborted:
                await self.transport.discard(handoff["ticket"], src)
                return
            if dst is None:
                self._finish(state, "error", "no decode rank could take the prefilled request"
                             + (f" (last: {last_error})" if last_error else ""))
                await self.transport.discard(handoff["ticket"], src)
                return
            tried.add(dst.uid)
            state.decode_rank = dst
            dst.inflight.add(rid)
            dst.pending_imports += 1
            try:
                try:
                    result = await asyncio.wait_for(
                        self.transport.deliver(handoff["ticket"], src, dst),
                        self.config.handoff_timeout_s)
                except asyncio.TimeoutError:
                    result = DeliveryResult(False, kind="transport", error=(
                        f"KV hand-off to {dst.name} timed out after "
                        f"{self.config.handoff_timeout_s:g}s"))
                    await self._abort_on(dst, rid)  # in case the import lands late
            finally:
                dst.pending_imports -= 1
            if result.ok:
                state.timings["kv_handoff_s"] = took = time.monotonic() - started
                self.metrics.handed_off(handoff["nbytes"], took)
                if state.aborted or state.finished:
                    await self._abort_on(dst, rid)
                    dst.inflight.discard(rid)
                elif state.stage == HANDOFF:
                    state.stage = DECODE
                return
            dst.inflight.discard(rid)
            last_error = result.error
            if state.finished:
                return
            if result.kind == "payload":
                self._finish(state, "error", f"KV payload rejected by {dst.name}: {result.error}")
                return
            if result.kind == "transport" and src.state == DEAD:
                self._recover(state, f"KV payload lost: {src.name} died")
                return
            # capacity or a decode rank gone: try the next one

    async def _rank_died(self, pool: Pool, rank: RankHandle, why: str) -> None:
        self.num_rank_failures += 1
        log.error("%s died: %s", rank.name, why)
        rank.state = DEAD
        rank.error = why
        try:  # if only its replies failed, make sure it is gone before the group re-forms
            ray.kill(rank.actor, no_restart=True)
        except Exception:
            pass
        cause = f"{rank.name} died ({why.splitlines()[0][:200]})"
        for rid in list(rank.inflight):
            state = self.tracker.get(rid)
            rank.inflight.discard(rid)
            if state is None or state.finished:
                continue
            if state.stage == HANDOFF:
                continue  # the delivery task sees the failure and recovers itself
            self._recover(state, cause)
        await pool.remove_dead(rank)

    # -- state -----------------------------------------------------------------------

    def cluster_state(self) -> dict:
        pools = []
        for pool in self.pools.values():
            ranks = []
            for r in pool.ranks:
                st = r.stats or {}
                ranks.append({
                    "rank": r.rank, "actor_id": r.actor._actor_id.hex() if r.actor else "",
                    "node_id": r.info.get("node_id", ""), "state": r.state,
                    "num_waiting": st.get("num_waiting", 0), "num_running": st.get("num_running", 0),
                    "num_prompted": st.get("num_prompted", 0),
                    "num_free_blocks": st.get("num_free_blocks", 0),
                    "num_total_blocks": st.get("num_total_blocks", r.info.get("num_total_blocks", 0)),
                    "kv_usage": float(st.get("kv_usage", 0.0)),
                    "outstanding_prompt_tokens": st.get("outstanding_prompt_tokens", 0),
                    "num_steps": st.get("num_steps", 0), "num_empty_steps": st.get("num_empty_steps", 0),
                    "num_preemptions": st.get("num_preemptions", 0), "num_inflight": len(r.inflight),
                })
            pools.append({"name": pool.name, "target_replicas": pool.target, "ranks": ranks,
                          "group_generation": pool.generation})
        return {"mode": self.config.mode, "model": self.config.model_dir, "pools": pools,
                "num_inflight": len(self.tracker), "max_queue_depth": self.config.max_queue_depth,
                "kv_transport": self.transport.name}

    async def timeline(self, since: float = 0.0) -> list[dict]:
        """Every live rank's step records that ended after unix time `since`."""
        ranks = [r for p in self.pools.values() for r in p.ranks if r.state != DEAD]
        results = await asyncio.gather(*(r.actor.timeline_records.remote(since) for r in ranks),
                                       return_exceptions=True)
        return [rec for res in results if isinstance(res, list) for rec in res]

    async def refresh_stats(self) -> None:
        ranks = [r for p in self.pools.values() for r in p.ranks if r.state != DEAD]
        results = await asyncio.gather(*(r.actor.stats.remote() for r in ranks),
                                       return_exceptions=True)
        for r, st in zip(ranks, results, strict=True):
            if isinstance(st, dict):
                r.stats = st

    async def scale(self, pool_name: str, replicas: int) -> int:
        pool = self.pools.get(pool_name)
        if pool is None:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pool must be one of {sorted(self.pools)}, got {pool_name!r}")
        if replicas < 1:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"replicas must be >= 1, got {replicas}")
        return await pool.scale(replicas)

