"""The data-parallel group's communicator.

The scheduler's step-kind votes (scheduler-spec S9/S10) are one-integer all-reduces
with MIN over the ranks of a data-parallel group; ``pdserve.scheduler.votes`` names
the protocol (``rank``, ``world_size``, ``all_reduce_min``). ``TorchDistCommunicator``
implements it over ``torch.distributed`` with a process group of its own (a
``ProcessGroupGloo`` or ``ProcessGroupNCCL`` built directly on a ``PrefixStore``), so:

- several groups can live in one process beside (or without) the default group;
- a group can be closed and a new one formed with another world size in the same
  processes (pool resizing: drain, ``close()``, build the next one);
- every collective has a timeout: a dead or hung peer makes ``all_reduce_min`` raise
  ``CollectiveError`` instead of wedging the rank;
- a rank told from outside that a peer is dead (``abort``) is released from a
  collective at once, without waiting for the timeout.

``listen_store`` hosts a ``TCPStore`` that listens on one address only (a plain
``TCPStore(host, ...)`` server listens on every interface, whatever ``host`` says).

``RankPool`` (engine/rank_pool.py) starts real rank processes that form such groups
(tests, benchmarks, labs).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveError",
    "TorchDistCommunicator",
    "listen_store",
]

DEFAULT_TIMEOUT_S = 30.0
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


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
        _check_group_shape(rank, world_size, timeout)
        backend, dev = _backend_and_device(backend, device)
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
        self._aborted: str | None = None
        self._done = threading.Event()  # the collective in progress ended (or was aborted)
        self._stuck: Any = None  # an aborted collective's (work, done), still running in gloo
        self._store: dist.Store | None = None  # held only when this rank created it
        self._pg: Any = None
        if world_size == 1:
            return  # the vote is the rank's own wish; no peers to wait for
        if init is None:
            raise ValueError("world_size > 1 needs init: a tcp://HOST:PORT address or a Store")
        base, gloo_host = self._base_store(init, gloo_host)
        store = dist.PrefixStore(f"{prefix}/", base)
        self._pg = _process_group(backend, store, rank, world_size,
                                  datetime.timedelta(seconds=self.timeout), gloo_host)
        self._op = dist.AllreduceOptions()
        self._op.reduceOp = dist.ReduceOp.MIN

    def _base_store(self, init: str | dist.Store,
                    gloo_host: str | None) -> tuple[dist.Store, str | None]:
        """The store the group rendezvouses on (hosted here by rank 0 of an address),
        and the interface gloo binds: loopback for a loopback store, so that every rank
        picks the same one."""
        if isinstance(init, str):
            host, port = _parse_tcp(init)
            if self.rank == 0:  # listening on that address only (see listen_store)
                self._store = listen_store(host, port, world_size=self.world_size,
                                           timeout=self.timeout)
            else:
                self._store = dist.TCPStore(host, port, self.world_size, False,
                                            timeout=datetime.timedelta(seconds=self.timeout))
            if gloo_host is None and host in LOOPBACK_HOSTS:
                gloo_host = "127.0.0.1"
            return self._store, gloo_host
        if isinstance(init, dist.Store):
            # A store this rank hosts (see EngineRank.open_group_store): the same
            # loopback rule as for its address, so all ranks pick the same interface.
            if gloo_host is None and getattr(init, "host", None) in LOOPBACK_HOSTS:
                gloo_host = "127.0.0.1"
            return init, gloo_host
        raise TypeError(f"init must be an address string or a torch.distributed.Store, got {type(init)}")

    @property
    def closed(self) -> bool:
        return self._closed

    def all_reduce_min(self, value: int) -> int:
        """The minimum of ``value`` over the group's ranks; every rank must call it."""
        done = self._done = threading.Event()  # before the check: see abort
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
            # Waited on through its future, so that abort can end the wait at once
            # (gloo's own wait cannot be interrupted); the group's timeout ends the work.
            ended = threading.Event()  # the work's own end, whatever abort says

            def on_end(_: Any) -> None:
                ended.set()
                done.set()

            work.get_future().add_done_callback(on_end)
            done.wait(self.timeout + 5.0)
            if self._aborted is not None:
                self._stuck = (work, ended)
                raise CollectiveError(f"aborted: {self._aborted}")
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

    def abort(self, why: str) -> None:
        """A peer is known to be dead (``why``): the collective in progress, if any, and
        every later one raise ``CollectiveError`` at once. From any thread; the group
        must then be closed (``close``) and formed again."""
        self._aborted = why
        self._broken = self._broken or f"aborted: {why}"
        pg = self._pg
        if pg is not None and self.backend == "nccl":  # pragma: no cover - needs GPUs
            pg.abort()  # releases a kernel waiting on the dead peer
        self._done.set()

    def close(self) -> None:
        """Tear the group down (idempotent). Peers must not be inside a collective."""
        if self._closed:
            return
        self._closed = True
        pg, self._pg = self._pg, None
        stuck, self._stuck = self._stuck, None
        if pg is not None:
            try:
                if self._broken is not None and hasattr(pg, "abort"):
                    pg.abort()
                else:
                    pg.shutdown()
            except Exception:  # a broken group may refuse a clean shutdown; drop it anyway
                pass
        if stuck is not None:
            # Destroying a gloo group waits for its running work (up to the timeout)
            # holding the GIL: a thread of its own keeps it until the work has ended.
            threading.Thread(target=_drop_when_done, args=(stuck[1], self.timeout + 5.0, pg,
                                                           stuck[0]),
                             name="group-reaper", daemon=True).start()
        del pg, stuck
        self._store = None

    def __enter__(self) -> TorchDistCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return (f"TorchDistCommunicator(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend!r}, name={self.name!r}, calls={self.calls}, {state})")


def _drop_when_done(done: threading.Event, timeout_s: float, *objects: Any) -> None:
    """Hold ``objects`` until ``done`` (at most ``timeout_s``); Thread.run drops them."""
    done.wait(timeout_s)


def _check_group_shape(rank: int, world_size: int, timeout: float) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")


def _backend_and_device(backend: str | None, device: str | torch.device | None
                        ) -> tuple[str, torch.device]:
    """The backend (by default NCCL for a CUDA device, gloo otherwise) and the device
    its value tensors live on, checked against each other."""
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
    return backend, dev


def _process_group(backend: str, store: dist.Store, rank: int, world_size: int,
                   timeout: datetime.timedelta, gloo_host: str | None) -> Any:
    """A process group of its own on ``store`` (not the default group), with ``timeout``
    on every collective."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)
                         if gloo_host else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    else:  # pragma: no cover - needs GPUs
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
