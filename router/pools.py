"""Pools of engine-rank actors: start, rendezvous, choose a rank, resize, lose a rank.

The controller lives in the router process and talks to ranks only through Ray
handles. A pool's data-parallel group is formed by asking its first rank to open the
group's store on its node (`open_group_store`) and handing that address to every rank's
`join_group` at once; a resize or a dead rank re-forms it the same way, with a new
generation number, after pausing the survivors at a common step boundary.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import ray
from pdserve.router.config import PoolConfig, RouterConfig

log = logging.getLogger(__name__)

STARTING, READY, DRAINING, DEAD = "starting", "ready", "draining", "dead"


def _actor_class(pool: str):
    if pool == "prefill":
        from pdserve.prefill_worker.actor import PrefillRank

        return PrefillRank
    from pdserve.decode_worker.actor import DecodeRank, NormalRank

    return DecodeRank if pool == "decode" else NormalRank


@dataclass
class RankHandle:
    pool: str
    actor: Any
    uid: int
    state: str = STARTING
    rank: int = -1
    info: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    inflight: set = field(default_factory=set)
    outstanding_tokens: int = 0   # prompt tokens sent here and not yet prefilled
    pending_imports: int = 0      # payloads on their way here
    assigned: int = 0             # requests ever sent here (breaks ties round-robin)
    poll_task: asyncio.Task | None = None
    error: str | None = None

    @property
    def free_blocks(self) -> int:
        return int(self.stats.get("num_free_blocks", self.info.get("num_total_blocks", 0)))

    @property
    def name(self) -> str:
        return f"{self.pool} rank {self.rank} (#{self.uid})"


class Pool:
    def __init__(self, config: PoolConfig, router_config: RouterConfig) -> None:
        self.config = config
        self.name = config.name
        self.rc = router_config
        self.ranks: list[RankHandle] = []
        self.generation = 0
        self.target = config.replicas
        self._uids = 0
        self.lock = asyncio.Lock()  # one resize / re-form at a time
        self.on_new_rank = None     # set by the router: starts the rank's poll loop
        self.on_rank_removed = None  # set by the router: recovers requests left on a rank

    # -- rank choice -----------------------------------------------------------------

    def ready(self) -> list[RankHandle]:
        return [r for r in self.ranks if r.state == READY]

    def choose_prefill(self) -> RankHandle | None:
        ranks = self.ready()
        if not ranks:
            return None
        rank = min(ranks, key=lambda r: (r.outstanding_tokens, len(r.inflight), r.assigned, r.uid))
        rank.assigned += 1
        return rank

    async def wait_for_rank(self, timeout_s: float) -> RankHandle | None:
        """The least-loaded ready rank, waiting while the pool (re-)forms."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            rank = self.choose_prefill()
            if rank is not None or loop.time() >= deadline or (self.target == 0):
                return rank
            await asyncio.sleep(0.05)

    async def wait_for_decode(self, exclude: set[int], timeout_s: float) -> RankHandle | None:
        """The decode rank with the most free blocks, waiting while the pool re-forms."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            rank = self.choose_decode(exclude)
            if rank is not None or loop.time() >= deadline or self.target == 0:
                return rank
            if not any(r.state != DEAD and r.uid not in exclude for r in self.ranks) \
                    and not self.lock.locked():
                return None  # nobody left to wait for
            await asyncio.sleep(0.05)

    def choose_decode(self, exclude: set[int] = frozenset()) -> RankHandle | None:
        ranks = [r for r in self.ready() if r.uid not in exclude]
        if not ranks:
            return None
        rank = max(ranks, key=lambda r: (r.free_blocks - 8 * r.pending_imports,
                                         -len(r.inflight), -r.assigned, -r.uid))
        rank.assigned += 1
        return rank

    # -- lifecycle -------------------------------------------------------------------

    def _new_actor(self) -> RankHandle:
        c = self.config
        engine = dict(c.engine, model_dir=self.rc.model_dir)
        if c.num_gpus:
            engine.setdefault("device", "cuda")  # Ray sets CUDA_VISIBLE_DEVICES for the actor
        cls = ray.remote(_actor_class(self.name))
        actor = cls.options(
            num_cpus=c.num_cpus, num_gpus=c.num_gpus or None, resources=dict(c.resources),
            max_concurrency=16, max_restarts=0,
        ).remote(
            engine,
            engine_factory=self.rc.engine_factory, loop_factory=self.rc.loop_factory,
            communicator_factory=self.rc.communicator_factory,
            kv_transport=self.rc.kv_transport, collective_timeout_s=self.rc.collective_timeout_s,
            num_threads=self.rc.torch_threads,
        )
        self._uids += 1
        return RankHandle(self.name, actor, self._uids)

    async def _start_actors(self, n: int) -> list[RankHandle]:
        handles = [self._new_actor() for _ in range(n)]
        infos = await asyncio.gather(*(h.actor.info.remote() for h in handles),
                                     return_exceptions=True)
        started = []
        for h, info in zip(handles, infos, strict=True):
            if isinstance(info, BaseException):
                log.error("%s rank failed to start: %s", self.name, info)
                ray.kill(h.actor, no_restart=True)
                continue
            h.info = info
            started.append(h)
        if len(started) < n:
            raise RuntimeError(f"{n - len(started)} of {n} {self.name} ranks failed to start")
        return started

    async def start(self) -> None:
        async with self.lock:
            new = await self._start_actors(self.target)
            await self._reform(new)

    async def _reform(self, members: list[RankHandle]) -> None:
        """Pause every member, then form a new group of exactly `members`."""
        live = [r for r in members if r.state != DEAD]
        if any(r.state != STARTING for r in live):
            await asyncio.gather(*(r.actor.pause.remote() for r in live if r.state != STARTING),
                                 return_exceptions=True)
        self.generation += 1
        if not live:
            self.ranks = [r for r in self.ranks if r.state == DEAD and r.inflight]
            return
        address = None
        if len(live) > 1:
            address = await live[0].actor.open_group_store.remote()
        peers_of = {r.uid: [p.actor for p in live if p.uid != r.uid] for r in live}
        results = await asyncio.gather(
            *(r.actor.join_group.remote(i, len(live), address, self.generation, peers_of[r.uid])
              for i, r in enumerate(live)), return_exceptions=True)
        failed = [res for res in results if isinstance(res, BaseException)]
        if failed:
            raise RuntimeError(f"{self.name} group re-form failed: {failed[0]}") from failed[0]
        for i, r in enumerate(live):
            r.rank = i
            was_new = r.state == STARTING
            if r.state != DRAINING:
                r.state = READY
            if was_new and self.on_new_rank is not None:
                self.on_new_rank(self, r)
        keep = {r.uid for r in live}
        self.ranks = live + [r for r in self.ranks if r.uid not in keep and r.state == DEAD
                             and r.inflight]

    async def scale(self, replicas: int, drain_timeout_s: float = 120.0) -> int:
        """Grow or shrink to `replicas` ranks without failing in-flight requests."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        async with self.lock:
            previous = len(self.ready())
            self.target = replicas
            current = self.ready()
            if replicas > len(current):
                new = await self._start_actors(replicas - len(current))
                await self._reform(current + new)
            elif replicas < len(current):
                leaving = current[replicas:]
                for r in leaving:
                    r.state = DRAINING  # no new admissions from now on
                await self._drain(leaving, drain_timeout_s)
                await self._reform(current[:replicas])
                for r in leaving:
                    r.state = DEAD
                    if r.poll_task is not None:
                        r.poll_task.cancel()
                    if r.inflight and self.on_rank_removed is not None:
                        # the drain timed out: its requests start again elsewhere
                        self.on_rank_removed(self, r, f"{r.name} was scaled down")
                    try:
                        await r.actor.shutdown.remote()
                    except Exception:
                        pass
                    ray.kill(r.actor, no_restart=True)
            return previous

    async def _drain(self, leaving: list[RankHandle], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if all(not r.inflight and r.pending_imports == 0 for r in leaving):
                idle = await asyncio.gather(*(r.actor.is_idle.remote() for r in leaving),
                                            return_exceptions=True)
                if all(i is True for i in idle):
                    return
            await asyncio.sleep(0.05)
        log.warning("%s: drain timed out; %d requests still on leaving ranks", self.name,
                    sum(len(r.inflight) for r in leaving))

    async def remove_dead(self, dead: RankHandle) -> None:
        """Re-form the group without a rank that died, replacing it to keep the target."""
        async with self.lock:
            dead.state = DEAD
            survivors = [r for r in self.ranks if r.state in (READY, DRAINING)]
            for r in survivors:
                r.state = STARTING if r.state == READY else r.state
            try:
                # Survivors' loops stop at the pause vote or when their collective times out.
                await asyncio.gather(*(r.actor.pause.remote() for r in survivors),
                                     return_exceptions=True)
                missing = self.target - len([r for r in survivors if r.state != DRAINING])
                new = await self._start_actors(missing) if missing > 0 else []
                for r in survivors:
                    if r.state == STARTING:
                        r.state = READY
                await self._reform(survivors + new)
            except Exception as exc:
                log.error("%s: re-forming after a dead rank failed: %s", self.name, exc)

    async def heal(self, generation: int) -> None:
        """Re-form the current group after a rank's loop failed (e.g. a collective timed out)."""
        async with self.lock:
            if generation != self.generation:
                return  # already re-formed since
            live = [r for r in self.ranks if r.state in (READY, DRAINING)]
            try:
                await self._reform(live)
            except Exception as exc:
                log.error("%s: healing the group failed: %s", self.name, exc)

    async def stop(self) -> None:
        for r in self.ranks:
            if r.poll_task is not None:
                r.poll_task.cancel()
        await asyncio.gather(*(r.actor.shutdown.remote() for r in self.ranks if r.state != DEAD),
                             return_exceptions=True)
        for r in self.ranks:
            try:
                ray.kill(r.actor, no_restart=True)
            except Exception:
                pass
        self.ranks = []
