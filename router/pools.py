"""Pools of engine-rank actors: start, rendezvous, choose a rank, resize, lose a rank.

The controller lives in the router process and talks to ranks only through Ray
handles. A pool's data-parallel group is formed by asking its first rank to open the
group's store on its node (`open_group_store`) and handing that address to every rank's
`join_group` at once; a resize or a dead rank re-forms it the same way, with a new
generation number, after pausing the survivors at a common step boundary. Every
formation gets a fresh random nonce (part of the store's key prefix, never logged),
and once every rank joined, rank 0 is told (`group_formed`) so it can close the store.

Ranks get the cluster's KV secret (`kv_secret`, made by the router) as an actor
argument: it reaches them through Ray only.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from pdserve.decode_worker.actor import DecodeRank
from pdserve.planner.host import RankStartError  # raised here; the planner acts on it
from pdserve.prefill_worker.actor import PrefillRank
from pdserve.rank.normal_rank import NormalRank
from pdserve.router import routing
from pdserve.router.config import PoolConfig, RouterConfig
from pdserve.router.rank_handle import DEAD, DRAINING, READY, STARTING, RankHandle
from pdserve.router.routing import PromptBlocks

log = logging.getLogger(__name__)

# How long a liveness check before a re-form waits for a rank's ping: a dead rank's call
# fails at once; a slow one is left to the join (bounded by group_timeout_s).
LIVENESS_CHECK_S = 1.0


def _actor_class(pool: str):
    if pool == "prefill":
        return PrefillRank
    if pool == "decode":
        return DecodeRank
    return NormalRank


@dataclass(frozen=True)
class Formation:
    """A group the pool formed: when (time.monotonic()), its generation and size."""

    at: float
    generation: int
    size: int


class Pool:
    def __init__(self, config: PoolConfig, router_config: RouterConfig,
                 kv_secret: Any = None) -> None:
        self.config = config
        self.kv_secret = kv_secret  # a KVSecret (its repr hides it), for the grpc transport
        self.name = config.name
        self.rc = router_config
        self.ranks: list[RankHandle] = []
        self.generation = 0
        self.target = config.replicas
        self._uids = 0
        self.lock = asyncio.Lock()  # the group: one re-form at a time
        self.resizing = asyncio.Lock()  # one resize (scale) at a time
        self.scaling: asyncio.Task | None = None  # the resize in progress, if any
        self.on_new_rank = None     # set by the router: starts the rank's poll loop
        self.on_rank_removed = None  # set by the router: recovers requests left on a rank
        self.formations: deque[Formation] = deque(maxlen=32)  # the latest groups formed
        self.refilling = 0  # replacements starting (refill)
        self._tasks: set[asyncio.Task] = set()  # the pool's own operations (refill)

    # -- rank choice -----------------------------------------------------------------

    def ready(self) -> list[RankHandle]:
        return [r for r in self.ranks if r.state == READY]

    def choose_prefill(self, prompt: PromptBlocks | None = None) -> RankHandle | None:
        """``cache_aware``: the rank with the lowest cost = its queue
        (``outstanding_tokens``: prompt tokens sent and not yet prefilled) +
        ``prefix_overlap_weight`` x the prompt's tokens past the prefix it holds (cached,
        or pending: sent there, being computed). Weight 1 estimates the prompt tokens
        computed before this one's first token; the default 2 also counts the work the
        cluster repeats by computing a prefix twice, so a shared prefix follows its cache
        unless that rank's queue is longer by more than the prompt. ``least_loaded``:
        the queue alone. Ties: requests in flight, then round-robin. Sets
        ``prompt.cached_tokens`` to the chosen rank's match."""
        return routing.choose_prefill(self.ready(), prompt, self.rc.routing,
                                      self.rc.prefix_overlap_weight)

    async def wait_for_rank(self, timeout_s: float,
                            give_up: Callable[[], bool] = lambda: False,
                            prompt: PromptBlocks | None = None) -> RankHandle | None:
        """The best ready rank for ``prompt`` (``choose_prefill``), waiting while the
        pool (re-)forms (None at once when `give_up()` turns true)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            rank = self.choose_prefill(prompt)
            if rank is not None or loop.time() >= deadline or self.target == 0 or give_up():
                return rank
            await asyncio.sleep(0.05)

    async def wait_for_decode(self, exclude: set[int], timeout_s: float,
                              give_up: Callable[[], bool] = lambda: False,
                              prompt_hashes: list[bytes] = ()) -> RankHandle | None:
        """The best decode rank (``choose_decode``), waiting while the pool re-forms
        (None at once when `give_up()` turns true: the request ended meanwhile)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            rank = self.choose_decode(exclude, prompt_hashes)
            if rank is not None or loop.time() >= deadline or self.target == 0 or give_up():
                return rank
            if not any(r.state != DEAD and r.uid not in exclude for r in self.ranks) \
                    and not self.changing:
                return None  # nobody left to wait for
            await asyncio.sleep(0.05)

    def choose_decode(self, exclude: set[int] = frozenset(),
                      prompt_hashes: list[bytes] = ()) -> RankHandle | None:
        """The decode rank with the most room once the payload is in: free blocks
        (less 8 per import on its way) plus, given the prompt's block names, the blocks
        of its prefix the rank's cache holds (they are not sent, nor allocated)."""
        return routing.choose_decode([r for r in self.ready() if r.uid not in exclude],
                                     prompt_hashes)

    # -- lifecycle -------------------------------------------------------------------

    def _new_actor(self) -> RankHandle:
        c = self.config
        # device "cuda" when the pool asks for GPUs: Ray sets the actor's CUDA_VISIBLE_DEVICES
        engine = c.rank_engine_settings(self.rc.model_dir)
        cls = ray.remote(_actor_class(self.name))
        actor = cls.options(
            num_cpus=c.num_cpus, num_gpus=c.num_gpus or None, resources=dict(c.resources),
            max_concurrency=16, max_restarts=0,
        ).remote(
            engine,
            engine_factory=self.rc.engine_factory, loop_factory=self.rc.loop_factory,
            communicator_factory=self.rc.communicator_factory,
            kv_transport=self.rc.kv_transport, collective_timeout_s=self.rc.collective_timeout_s,
            threads=c.threads, pool_size=self.target, max_failed_steps=self.rc.max_failed_steps,
            kv_secret=self.kv_secret,
        )
        self._uids += 1
        return RankHandle(self.name, actor, self._uids)

    async def _start_actors(self, n: int) -> list[RankHandle]:
        """Start `n` ranks, each within `rank_start_timeout_s` (an actor Ray cannot place
        stays pending: that is a failure too); all of them or none."""
        handles = [self._new_actor() for _ in range(n)]
        try:
            infos = await asyncio.gather(
                *(asyncio.wait_for(h.actor.info.remote(), self.rc.rank_start_timeout_s)
                  for h in handles), return_exceptions=True)
        except BaseException:  # cancelled: none of them joins
            for h in handles:
                _kill(h)
            raise
        failed = [(h, info) for h, info in zip(handles, infos, strict=True)
                  if isinstance(info, BaseException)]
        for h, info in zip(handles, infos, strict=True):
            if not isinstance(info, BaseException):
                h.info = info
        if failed:
            for h in handles:
                _kill(h)
            h, why = failed[0]
            if isinstance(why, asyncio.TimeoutError):
                why = TimeoutError(f"not ready within {self.rc.rank_start_timeout_s:g}s "
                                   "(the cluster could not place it, or it is loading slowly)")
            log.error("%d of %d %s ranks failed to start: %s", len(failed), n, self.name, why)
            raise RankStartError(f"{len(failed)} of {n} new {self.name} ranks failed to "
                                 f"start: {type(why).__name__}: {why}")
        return handles

    async def start(self) -> None:
        async with self.lock:
            new = await self._start_actors(self.target)
            await self._reform(new)

    async def _reform(self, members: list[RankHandle], tries: int = 4,
                      dead_peer: str = "") -> None:
        """Pause every member, then form a new group of exactly the live ones.

        ``dead_peer`` (why a member of the current group died): the members abort their
        group rather than wait for a step boundary the dead one can never reach.
        Bounded: pausing and joining each take at most `group_timeout_s`. Members Ray
        reports dead are left out first; if the group does not form, members that no
        longer answer are declared dead (their requests move) and it is formed again,
        at most `tries` times; survivors are never left without a loop."""
        for attempt in range(tries):
            await self._drop_dead(members)
            live = [r for r in members if r.state != DEAD]
            if attempt == tries - 1 and len(live) > 1:
                # Last resort: a group of one forms without a rendezvous, so the pool
                # keeps a loop; the others' requests move to it.
                for r in live[1:]:
                    self._declare_dead(r, f"the group did not form in {tries - 1} tries",
                                       replace=False)
                live = live[:1]
            await self._pause(live, dead_peer)
            self.generation += 1
            if not live:
                self.ranks = [r for r in self.ranks if r.state == DEAD and r.inflight]
                return
            address = None
            try:
                if len(live) > 1:
                    address = await asyncio.wait_for(live[0].actor.open_group_store.remote(),
                                                      self.rc.group_timeout_s)
            except Exception as exc:
                self._declare_dead(live[0], f"it could not host the group store: {exc}")
                continue
            if not await self._join(live, address):
                continue
            if address is not None:
                await self._close_store(live[0])
            self._formed(live)
            return
        raise RuntimeError(f"{self.name} group could not be formed in {tries} tries")

    async def _pause(self, live: list[RankHandle], dead_peer: str = "") -> None:
        """Stop the loops of the members that run one, at a shared step boundary (or,
        ``dead_peer``, at once: see ``_reform``)."""
        if any(r.state != STARTING for r in live):
            await asyncio.gather(
                *(asyncio.wait_for(r.actor.pause.remote(dead_peer=dead_peer),
                                   self.rc.group_timeout_s)
                  for r in live if r.state != STARTING), return_exceptions=True)

    async def _drop_dead(self, members: list[RankHandle]) -> None:
        """Declare dead the members whose process Ray reports gone (a dead actor's call
        fails at once), so that no survivor waits in a rendezvous for them. A member
        that is only slow to answer stays: joining the group decides for it."""
        live = [r for r in members if r.state != DEAD]
        answers = await asyncio.gather(
            *(asyncio.wait_for(r.actor.ping.remote(), LIVENESS_CHECK_S) for r in live),
            return_exceptions=True)
        for r, answer in zip(live, answers, strict=True):
            if isinstance(answer, ray.exceptions.RayActorError):
                self._declare_dead(r, f"its process is gone: {answer}".splitlines()[0])

    async def _join(self, live: list[RankHandle], address: str | None) -> bool:
        """Every member joins group ``self.generation``; False (members that no longer
        answer declared dead) when any join failed."""
        peers_of = {r.uid: [p.actor for p in live if p.uid != r.uid] for r in live}
        nonce = secrets.token_hex(16)  # this formation's store keys; never logged
        results = await asyncio.gather(
            *(asyncio.wait_for(r.actor.join_group.remote(i, len(live), address,
                                                         self.generation, peers_of[r.uid],
                                                         nonce=nonce),
                               self.rc.group_timeout_s)
              for i, r in enumerate(live)), return_exceptions=True)
        failed = [(r, res) for r, res in zip(live, results, strict=True)
                  if isinstance(res, BaseException)]
        if not failed:
            return True
        # A rank that timed out waiting for a slow peer is not to blame: only the
        # ones that no longer answer are dropped; the rest try again.
        log.warning("%s: forming group %d failed (%s: %s); retrying", self.name,
                    self.generation, type(failed[0][1]).__name__, failed[0][1])
        answers = await asyncio.gather(
            *(asyncio.wait_for(r.actor.ping.remote(), self.rc.rank_call_timeout_s)
              for r in live), return_exceptions=True)
        for r, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                self._declare_dead(r, "it failed to join the group and does not "
                                   f"answer: {type(answer).__name__}: {answer}")
        return False

    async def _close_store(self, first: RankHandle) -> None:
        """Every rank joined: rank 0 may close the store (nobody can reach it then)."""
        try:
            await asyncio.wait_for(first.actor.group_formed.remote(self.generation),
                                   self.rc.rank_call_timeout_s)
        except Exception as exc:  # the store stays open; the group works anyway
            log.warning("%s: rank 0 did not close group %d's store: %s", self.name,
                        self.generation, exc)

    def _formed(self, live: list[RankHandle]) -> None:
        """The group of ``live`` formed: they are the pool's ranks, in group order."""
        for i, r in enumerate(live):
            r.rank = i
            was_new = r.state == STARTING
            if r.state != DRAINING:
                r.state = READY
            if was_new:
                r.ready_at = time.monotonic()
            if was_new and self.on_new_rank is not None:
                self.on_new_rank(self, r)
        self.formations.append(Formation(time.monotonic(), self.generation, len(live)))
        keep = {r.uid for r in live}
        self.ranks = live + [r for r in self.ranks if r.uid not in keep and r.state == DEAD
                             and r.inflight]

    def _declare_dead(self, r: RankHandle, why: str, replace: bool = True) -> None:
        """``r`` is gone (killed here if it was not); ``replace``: a new rank is started
        for it once the re-form in progress is done (refill)."""
        log.error("%s: %s", r.name, why)
        was_serving = r.state != STARTING
        r.state = DEAD
        r.error = why
        _kill(r)
        if r.poll_task is not None:
            r.poll_task.cancel()
        if was_serving and self.on_rank_removed is not None:
            self.on_rank_removed(self, r, f"{r.name} died ({why[:200]})")
        if replace and was_serving:
            self._spawn(self.refill())

    async def scale(self, replicas: int) -> int:
        """Grow or shrink to `replicas` ranks without failing in-flight requests.

        Runs as a pool operation (the router spawns it; a caller that leaves does not
        stop it), one at a time (``resizing``). Growing: every new rank starts in time
        or none joins, and the pool stays at its previous size. Shrinking: the leaving
        ranks take no new work, drain for up to `drain_timeout_s` (payloads they
        exported included), and what is left on them then moves to the ranks that
        stay. The group itself is locked only while it re-forms: a rank that dies while
        new ranks load or leaving ones drain is re-formed away at once."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        async with self.resizing:
            previous, previous_target = len(self.ready()), self.target
            self.target = replicas
            try:
                if replicas > previous:
                    await self._grow()
                elif replicas < previous:
                    await self._shrink(replicas)
            except BaseException:
                self.target = previous_target
                raise
            return previous

    async def _grow(self) -> None:
        """Start ranks for what the target misses (all in time, or RankStartError), then
        re-form with as many as the target still misses (a refill or a resize may have
        filled it meanwhile; the rest are stopped)."""
        async with self.lock:  # counted once a re-form in progress is done
            missing = self.target - len(self.ready())
        if missing <= 0:
            return
        new = await self._start_actors(missing)
        async with self.lock:
            room = max(0, self.target - len(self.ready()))
            for h in new[room:]:
                _kill(h)
            if room:
                await self._reform(self._members() + new[:room])

    def _members(self) -> list[RankHandle]:
        """The ranks in the pool's group: ready, or draining before they leave."""
        return [r for r in self.ranks if r.state in (READY, DRAINING)]

    async def _shrink(self, replicas: int) -> None:
        leaving = self.ready()[replicas:]
        for r in leaving:
            r.state = DRAINING  # no new admissions from now on
        try:
            await self._drain(leaving, self.rc.drain_timeout_s)
        finally:
            # However the drain ended (or was cancelled), the leaving ranks go and what
            # is left on them moves: never a rank left draining.
            await asyncio.shield(self._retire(leaving))

    async def _retire(self, leaving: list[RankHandle]) -> None:
        """The leaving ranks stop and the rest re-form; under the group lock, so that a
        re-form in progress (a death's heal, which counts draining ranks as members)
        never waits in its rendezvous for a rank stopped under it (seen: 10 s)."""
        async with self.lock:
            for r in leaving:
                r.state = DEAD
                if r.poll_task is not None:
                    r.poll_task.cancel()
                if (r.inflight or r.exports) and self.on_rank_removed is not None:
                    self.on_rank_removed(self, r, f"{r.name} was scaled down")
            await asyncio.gather(*(asyncio.wait_for(r.actor.shutdown.remote(), 10.0)
                                   for r in leaving), return_exceptions=True)
            for r in leaving:
                _kill(r)
            await self._reform(self._members())

    async def _drain(self, leaving: list[RankHandle], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if all(not r.inflight and not r.exports and r.pending_imports == 0
                   for r in leaving):
                idle = await asyncio.gather(
                    *(asyncio.wait_for(r.actor.is_idle.remote(), self.rc.rank_call_timeout_s)
                      for r in leaving), return_exceptions=True)
                if all(i is True for i in idle):
                    return
            await asyncio.sleep(0.05)
        log.warning("%s: drain timed out; %d requests still on leaving ranks move", self.name,
                    sum(len(r.inflight) for r in leaving))

    async def remove_dead(self, dead: RankHandle, why: str = "") -> None:
        """Re-form the group of the survivors at once (they abort the votes the dead rank
        left them in), then replace the dead rank to keep the target: the new rank
        starts while the survivors serve, and joins them with one more re-form."""
        async with self.lock:
            dead.state = DEAD
            try:
                await self._reform(self._members(), dead_peer=f"{dead.name} died {why}".strip())
            except Exception as exc:
                log.error("%s: re-forming after a dead rank failed: %s", self.name, exc)
        self._spawn(self.refill())

    async def refill(self) -> None:
        """Replace ranks the pool lost (``_grow``); a pool operation of its own, so the
        survivors serve while the new ranks load."""
        self.refilling += 1
        try:
            await self._grow()
        except Exception as exc:  # serve on with the survivors
            log.error("%s: no replacement rank: %s", self.name, exc)
        finally:
            self.refilling -= 1

    @property
    def changing(self) -> bool:
        """A re-form, resize or replacement is under way (its ranks may come)."""
        return self.lock.locked() or self.resizing.locked() or self.refilling > 0 or \
            (self.scaling is not None and not self.scaling.done())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def heal(self, generation: int) -> None:
        """Re-form the current group after a rank's loop failed (e.g. a collective timed out)."""
        async with self.lock:
            if generation != self.generation:
                return  # already re-formed since
            try:
                await self._reform(self._members())
            except Exception as exc:
                log.error("%s: healing the group failed: %s", self.name, exc)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for r in self.ranks:
            if r.poll_task is not None:
                r.poll_task.cancel()
        await asyncio.gather(*(asyncio.wait_for(r.actor.shutdown.remote(), 10.0)
                               for r in self.ranks if r.state != DEAD), return_exceptions=True)
        for r in self.ranks:
            _kill(r)
        self.ranks = []


def _kill(r: RankHandle) -> None:
    try:
        ray.kill(r.actor, no_restart=True)
    except Exception:  # already gone
        pass
