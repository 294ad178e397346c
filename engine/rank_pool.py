"""A launcher of real rank processes for the data-parallel group's tests.

``RankPool`` / ``run_ranks`` start N real processes (multiprocessing ``forkserver``, else
``spawn``; never a bare ``fork``) that share a store hosted by the launching process and
run functions on every rank, returning the per-rank results. Each rank forms groups
(``TorchDistCommunicator``, engine/dp_comm.py) through its ``RankContext``. Tests use
it; so can benchmarks and labs.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.dp_comm import LOOPBACK_HOSTS, TorchDistCommunicator, listen_store

__all__ = [
    "DeadRank",
    "RankContext",
    "RankError",
    "RankPool",
    "run_ranks",
]


@dataclass
class RankContext:
    """What a function run by ``RankPool`` gets on its rank (first argument)."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    task_id: int = 0
    _store: Any = field(default=None, repr=False)

    @property
    def store(self) -> dist.Store:
        """The launcher's shared store (a ``TCPStore`` client), connected on first use."""
        if self._store is None:
            self._store = dist.TCPStore(self.store_host, self.store_port, None, False,
                                        timeout=datetime.timedelta(seconds=60))
        return self._store

    def communicator(self, name: str = "", *, rank: int | None = None,
                     world_size: int | None = None, timeout: float = 10.0,
                     **kwargs: Any) -> TorchDistCommunicator:
        """A communicator on the shared store, named uniquely for this run.

        Ranks that pass the same ``name`` in the same run form one group; pass
        ``rank``/``world_size`` to form a smaller (or re-numbered) group.
        """
        if self.store_host in LOOPBACK_HOSTS and kwargs.get("backend") in (None, "gloo"):
            kwargs.setdefault("gloo_host", "127.0.0.1")
        return TorchDistCommunicator(
            self.rank if rank is None else rank,
            self.world_size if world_size is None else world_size,
            self.store, timeout=timeout, prefix=f"run{self.task_id}/{name}", **kwargs)


@dataclass(frozen=True)
class DeadRank:
    """The entry of a rank whose process died before returning (``allow_dead=True``)."""

    rank: int
    exitcode: int | None


class RankError(RuntimeError):
    """A rank's function raised, a rank died, or a run timed out."""


def _fn_ref(fn: Callable) -> tuple[str, str, str | None]:
    if "<" in fn.__qualname__:
        raise ValueError(f"{fn.__qualname__} must be a module-level function to run on ranks")
    try:
        path = sys.modules[fn.__module__].__file__
    except (KeyError, AttributeError):
        path = None
    return fn.__module__, fn.__qualname__, path


def _resolve(ref: tuple[str, str, str | None]) -> Callable:
    module_name, qualname, path = ref
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        # Test modules imported by pytest's importlib mode have names that are not
        # importable elsewhere: load the file itself (once per process).
        if path is None:
            raise
        alias = "_pdserve_rank_fn_" + str(abs(hash(path)))
        obj = sys.modules.get(alias)
        if obj is None:
            spec = importlib.util.spec_from_file_location(alias, path)
            obj = importlib.util.module_from_spec(spec)
            sys.modules[alias] = obj
            spec.loader.exec_module(obj)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(rank: int, world_size: int, host: str, port: int, tasks: Any,
                 results: Any, threads: int) -> None:
    torch.set_num_threads(threads)
    ctx = RankContext(rank, world_size, host, port)
    results.put((0, rank, True, "ready"))
    while True:
        msg = tasks.get()
        if msg is None:
            break
        task_id, ref, args, kwargs = msg
        ctx.task_id = task_id
        try:
            out = (task_id, rank, True, _resolve(ref)(ctx, *args, **kwargs))
        except BaseException:
            out = (task_id, rank, False, traceback.format_exc())
        try:
            pickle.dumps(out)  # the queue pickles in a background thread and drops failures
        except Exception:
            out = (task_id, rank, False, "the result cannot be pickled:\n" + traceback.format_exc())
        results.put(out)
    # Flush what this rank sent, then skip interpreter teardown (seconds with torch
    # loaded, on a busy machine): nothing else in a rank process needs finalizing.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _context(start_method: str | None) -> Any:
    """``forkserver`` where there is one: a clean single-threaded server imports torch
    once and forks every rank from it (seconds saved per rank on a small machine);
    ``spawn`` elsewhere. Never plain ``fork`` of a process that may run threads."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method == "fork":
        raise ValueError("start_method 'fork' is unsafe here; use 'forkserver' or 'spawn'")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload([__name__])
    return ctx


class RankPool:
    """``world_size`` long-lived rank processes that run functions together.

    ``run(fn, *args, **kwargs)`` calls ``fn(ctx, *args, **kwargs)`` on every rank (or
    on ``ranks``), where ``ctx`` is the rank's ``RankContext``, and returns the results
    in rank order. ``fn`` must be a module-level function. The launching process hosts
    the shared store, so any rank may die without taking the store with it.
    Processes start once (importing torch costs seconds); reuse the pool across runs.
    """

    def __init__(self, world_size: int, *, threads_per_rank: int = 1,
                 host: str = "127.0.0.1", start_method: str | None = None,
                 ready_timeout: float = 120.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._store = listen_store(host, 0, timeout=60.0)
        self._mp = _context(start_method)
        self._results = self._mp.Queue()
        self._tasks = [self._mp.Queue() for _ in range(world_size)]
        self._procs = []
        self._next_task = 1
        self._closed = False
        for r in range(world_size):
            p = self._mp.Process(
                target=_worker_main, name=f"pdserve-rank{r}", daemon=True,
                args=(r, world_size, host, self._store.port, self._tasks[r], self._results,
                      threads_per_rank))
            p.start()
            self._procs.append(p)
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        """Block until every rank has started (imports done), so the first run's
        rendezvous does not spend its timeout on a slow start."""
        missing = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while missing:
            try:
                tid, r, _, _ = self._results.get(timeout=0.1)
                if tid == 0:
                    missing.discard(r)
                continue
            except queue.Empty:
                pass
            dead = [r for r in missing if not self._procs[r].is_alive()]
            if dead or time.monotonic() > deadline:
                self.close()
                why = f"ranks {dead} died" if dead else f"not started within {timeout:g}s"
                raise RankError(f"rank pool of {self.world_size}: ranks {sorted(missing)} {why}")

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self._procs]

    def run(self, fn: Callable, *args: Any, ranks: list[int] | None = None,
            timeout: float = 120.0, allow_dead: bool = False, **kwargs: Any) -> list[Any]:
        """Run ``fn`` on ``ranks`` (default all); return their results in that order.

        A rank that raises makes this raise ``RankError`` with its traceback (once every
        rank has answered or died). A rank that dies yields a ``DeadRank`` entry when
        ``allow_dead`` is set, else a ``RankError``. Past ``timeout`` seconds the pool is
        closed and ``RankError`` raised.
        """
        if self._closed:
            raise RankError("the rank pool is closed")
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        task_id = self._next_task
        self._next_task += 1
        ref = _fn_ref(fn)
        for r in ranks:
            if not self._procs[r].is_alive():
                raise RankError(f"rank {r} is dead (exit code {self._procs[r].exitcode})")
            self._tasks[r].put((task_id, ref, args, kwargs))
        got, errors = self._gather(fn, task_id, ranks, timeout)
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{fn.__qualname__} raised on ranks {sorted(errors)}:\n{text}")
        dead = [r for r in ranks if isinstance(got[r], DeadRank)]
        if dead and not allow_dead:
            raise RankError(f"{fn.__qualname__}: ranks {dead} died "
                            f"(exit codes {[got[r].exitcode for r in dead]})")
        return [got[r] for r in ranks]

    def _gather(self, fn: Callable, task_id: int, ranks: list[int],
                timeout: float) -> tuple[dict[int, Any], dict[int, str]]:
        """Each rank's answer to ``task_id``: its result (a ``DeadRank`` if it died), or
        its traceback; past ``timeout`` seconds the pool is closed and RankError raised."""
        pending = set(ranks)
        got: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            try:
                tid, r, ok, payload = self._results.get(timeout=0.1)
            except queue.Empty:
                self._note_dead(pending, got)
                if time.monotonic() > deadline:
                    self.close()
                    raise RankError(f"{fn.__qualname__}: ranks {sorted(pending)} gave no result "
                                    f"within {timeout:g}s; errors so far: {errors}") from None
                continue
            if tid != task_id or r not in pending:
                continue  # a late answer from an earlier, abandoned run
            pending.discard(r)
            if ok:
                got[r] = payload
            else:
                errors[r] = payload
        return got, errors

    def _note_dead(self, pending: set[int], got: dict[int, Any]) -> None:
        for r in list(pending):
            p = self._procs[r]
            if not p.is_alive():
                pending.discard(r)
                got[r] = DeadRank(r, p.exitcode)

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        for q, p in zip(self._tasks, self._procs, strict=True):
            if p.is_alive():
                q.put(None)
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():  # pragma: no cover - terminate ignored
                os.kill(p.pid, 9)
                p.join(1.0)
        for q in [*self._tasks, self._results]:
            q.close()
            q.cancel_join_thread()
        self._store = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              allow_dead: bool = False, **kwargs: Any) -> list[Any]:
    """Start ``world_size`` rank processes, run ``fn(ctx, *args, **kwargs)`` on each once,
    stop them, and return the per-rank results (see ``RankPool.run``)."""
    with RankPool(world_size) as pool:
        return pool.run(fn, *args, timeout=timeout, allow_dead=allow_dead, **kwargs)
