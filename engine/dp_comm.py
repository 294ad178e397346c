"""The data-parallel group's communicator, and a launcher of real rank processes.

The scheduler's step-kind votes (scheduler-spec S9/S10) are one-integer all-reduces
with MIN over the ranks of a data-parallel group; ``pdserve.scheduler.votes`` names
the protocol (``rank``, ``world_size``, ``all_reduce_min``). ``TorchDistCommunicator``
implements it over ``torch.distributed`` with a process group of its own (a
``ProcessGroupGloo`` or ``ProcessGroupNCCL`` built directly on a ``PrefixStore``), so:

- several groups can live in one process beside (or without) the default group;
- a group can be closed and a new one formed with another world size in the same
  processes (pool resizing: drain, ``close()``, build the next one);
- every collective has a timeout: a dead or hung peer makes ``all_reduce_min`` raise
  ``CollectiveError`` instead of wedging the rank.

``listen_store`` hosts a ``TCPStore`` that listens on one address only (a plain
``TCPStore(host, ...)`` server listens on every interface, whatever ``host`` says).

``RankPool`` / ``run_ranks`` start N real processes (multiprocessing ``forkserver``, else
``spawn``; never a bare ``fork``) that share a store hosted by the launching process and
run functions on every rank, returning the per-rank results. Tests use it; so can
benchmarks and labs.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveError",
    "DeadRank",
    "RankContext",
    "RankError",
    "RankPool",
    "TorchDistCommunicator",
    "listen_store",
    "run_ranks",
]

DEFAULT_TIMEOUT_S = 30.0
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class CollectiveError(RuntimeError):
    """A collective failed: a peer died or hung past the timeout, or the group is closed."""


def listen_store(host: str, port: int = 0, *, world_size: int | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``host`` only (port 0: one the OS picks; read it
    from ``.port``).

    ``TCPStore(host, port, is_master=True)`` binds every interface (``*:port``) in torch
    2.13, with either backend (libuv or not); ``host`` only names what clients dial. So
    the socket is bound and listening here first and handed over (``master_listen_fd``):
    the store owns the descriptor from then on and closes it when it is destroyed.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    bound = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(host, bound, world_size, True,
                             timeout=datetime.timedelta(seconds=timeout),
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def _parse_tcp(address: str) -> tuple[str, int]:
    url = urlparse(address)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"init address must look like tcp://HOST:PORT, got {address!r}")
    return url.hostname, url.port


class TorchDistCommunicator:
    """One rank's handle on a data-parallel group: ``all_reduce_min`` with a timeout.

    ``init`` is either an address ``"tcp://HOST:PORT"`` (rank 0 hosts a ``TCPStore``
    there, the others connect; use a fresh port for each group formed) or an existing
    ``torch.distributed.Store`` shared by the ranks (then give every group formed on it
    a distinct ``prefix``). ``world_size == 1`` needs no ``init`` and no peers.

    ``backend`` is ``"gloo"`` or ``"nccl"``; by default it follows ``device``: NCCL
    for a CUDA device (its value tensors live there), gloo otherwise. ``timeout``
    (seconds) bounds every collective and the group's rendezvous. ``calls`` counts
    ``all_reduce_min`` calls and ``seconds`` the time spent in them.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        init: str | dist.Store | None = None,
        *,
        backend: str | None = None,
        device: str | torch.device | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        prefix: str = "pdserve/dp",
        gloo_host: str | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        dev = torch.device(device) if device is not None else None
        if backend is None:
            backend = "nccl" if dev is not None and dev.type == "cuda" else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl":
            if dev is None:
                dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            if dev is None or dev.type != "cuda":
                raise ValueError("the nccl backend needs a CUDA device (its tensors live on the GPU)")
            if not dist.is_nccl_available():
                raise ValueError("this torch build has no NCCL; use backend='gloo'")
        elif dev is None:
            dev = torch.device("cpu")
        elif dev.type != "cpu":
            raise ValueError(f"the gloo backend reduces CPU tensors, got device {dev}")

        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = dev
        self.timeout = float(timeout)
        self.prefix = prefix
        # What errors and the repr call the group: the prefix, unless it holds something
        # not to be shown (the router's per-group nonce; see EngineRank.join_group).
        self.name = prefix if name is None else name
        self.calls = 0
        self.seconds = 0.0
        self._closed = False
        self._broken: str | None = None
        self._store: dist.Store | None = None  # held only when this rank created it
        self._pg: Any = None
        if world_size == 1:
            return  # the vote is the rank's own wish; no peers to wait for
        if init is None:
            raise ValueError("world_size > 1 needs init: a tcp://HOST:PORT address or a Store")
        td = datetime.timedelta(seconds=self.timeout)
        if isinstance(init, str):
            host, port = _parse_tcp(init)
            if rank == 0:  # listening on that address only (see listen_store)
                self._store = listen_store(host, port, world_size=world_size,
                                           timeout=self.timeout)
            else:
                self._store = dist.TCPStore(host, port, world_size, False, timeout=td)
            base = self._store
            if gloo_host is None and host in _LOOPBACK:
                gloo_host = "127.0.0.1"
        elif isinstance(init, dist.Store):
            base = init
            # A store this rank hosts (see EngineRank.open_group_store): the same
            # loopback rule as for its address, so all ranks pick the same interface.
            if gloo_host is None and getattr(init, "host", None) in _LOOPBACK:
                gloo_host = "127.0.0.1"
        else:
            raise TypeError(f"init must be an address string or a torch.distributed.Store, got {type(init)}")
        store = dist.PrefixStore(f"{prefix}/", base)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = td
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)
                             if gloo_host else dist.ProcessGroupGloo.create_default_device()]
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
        else:  # pragma: no cover - needs GPUs
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            opts.is_high_priority_stream = False
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        self._op = dist.AllreduceOptions()
        self._op.reduceOp = dist.ReduceOp.MIN

    @property
    def closed(self) -> bool:
        return self._closed

    def all_reduce_min(self, value: int) -> int:
        """The minimum of ``value`` over the group's ranks; every rank must call it."""
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: the group ({self.name}) is closed")
        if self._broken is not None:
            raise CollectiveError(f"rank {self.rank}: the group ({self.name}) failed earlier: "
                                  f"{self._broken}")
        self.calls += 1
        if self._pg is None:
            return int(value)
        start = time.perf_counter()
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        try:
            work = self._pg.allreduce([t], self._op)
            work.wait(datetime.timedelta(seconds=self.timeout))
            out = int(t.item())
        except Exception as e:  # gloo and NCCL raise RuntimeError subclasses or DistErrors
            self._broken = f"{type(e).__name__}: {e}"
            raise CollectiveError(
                f"rank {self.rank}/{self.world_size}: all_reduce_min failed on group "
                f"{self.name!r} (a peer died, hung past {self.timeout:g}s, or left): {e}"
            ) from e
        finally:
            self.seconds += time.perf_counter() - start
        return out

    def close(self) -> None:
        """Tear the group down (idempotent). Peers must not be inside a collective."""
        if self._closed:
            return
        self._closed = True
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                if self._broken is not None and hasattr(pg, "abort"):
                    pg.abort()
                else:
                    pg.shutdown()
            except Exception:  # a broken group may refuse a clean shutdown; drop it anyway
                pass
        self._store = None

    def __enter__(self) -> TorchDistCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return (f"TorchDistCommunicator(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend!r}, name={self.name!r}, calls={self.calls}, {state})")


# ---------------------------------------------------------------------------------------
# Launching real rank processes.


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
        if self.store_host in _LOOPBACK and kwargs.get("backend") in (None, "gloo"):
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
        pending = set(ranks)
        got: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            try:
                tid, r, ok, payload = self._results.get(timeout=0.1)
            except queue.Empty:
                for r in list(pending):
                    p = self._procs[r]
                    if not p.is_alive():
                        pending.discard(r)
                        got[r] = DeadRank(r, p.exitcode)
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
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{fn.__qualname__} raised on ranks {sorted(errors)}:\n{text}")
        dead = [r for r in ranks if isinstance(got[r], DeadRank)]
        if dead and not allow_dead:
            raise RankError(f"{fn.__qualname__}: ranks {dead} died "
                            f"(exit codes {[got[r].exitcode for r in dead]})")
        return [got[r] for r in ranks]

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
