"""A rank's membership in its pool's data-parallel group (every engine rank has one).

The group is formed by ``join_group`` with an address the pool controller got from rank
0's ``open_group_store`` (rendezvous through Ray, no fixed port), and re-formed the same
way after a resize or a dead peer: ``pause`` stops every rank of the pool at the same
step boundary (a vote), then the next ``join_group`` starts a new loop with the new
group. The store's keys carry a random nonce per group, and rank 0 closes the store once
every rank joined (``group_formed``, gloo only; see ``open_group_store`` for what torch
allows). The engine keeps one ``GroupCommunicator`` for its whole life; the group
behind it is swapped.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.rank.messages import DEFAULT_COLLECTIVE_TIMEOUT_S, GroupJoined
from pdserve.scheduler.votes import SingleRankCommunicator

# The loop's has-work vote is 0 (work) / 1 (none); -1 asks every rank to pause.
_PAUSE_VOTE = -1


class _PausingCommunicator:
    """Wraps the loop's vote so one rank can stop the whole pool at a step boundary.

    Once any rank votes `_PAUSE_VOTE`, every rank sees it in the same round and
    from then on answers "no work" without a collective, so none waits on a peer.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.pause_requested = False
        self.paused = threading.Event()

    def all_reduce_min(self, value: int) -> int:
        if self.paused.is_set():
            return 1
        result = self.inner.all_reduce_min(_PAUSE_VOTE if self.pause_requested else value)
        if result == _PAUSE_VOTE:
            self.paused.set()
            return 1
        return result


class GroupCommunicator:
    """The engine's communicator for its whole life: the data-parallel group behind it
    is replaced whenever the pool re-forms (the engine never sees the swap)."""

    def __init__(self) -> None:
        self.group: Any = SingleRankCommunicator()

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def all_reduce_min(self, value: int) -> int:
        return self.group.all_reduce_min(value)


def default_communicator_factory(rank: int, world_size: int, address: Any,
                                 timeout_s: float, prefix: str, device: str | None = None,
                                 name: str | None = None) -> Any:
    """``address``: the group store's tcp:// address, or (rank 0) a client of the store
    it hosts. ``prefix`` holds the group's nonce; ``name`` is what errors may show."""
    # lazy: engine.dp_comm imports torch; the router imports this module
    from pdserve.engine.dp_comm import TorchDistCommunicator

    # The backend follows the device: NCCL for ranks on a GPU, gloo on CPU.
    return TorchDistCommunicator(rank, world_size, address, timeout=timeout_s, prefix=prefix,
                                 device=device, name=name)



def device_name(configured: str | None) -> str:
    """The engine's device as torch names it ("cpu", "cuda:0"): a bare "cuda" is the
    current CUDA device (Ray's CUDA_VISIBLE_DEVICES chose it), "auto" what the engine
    resolves it to (engine/config.py: engine_device)."""
    device = configured or "cpu"
    if device in ("cuda", "auto"):
        import torch  # lazy: only a rank gets here; the router imports this module

        if device == "auto" and not torch.cuda.is_available():
            return "cpu"
        device = f"cuda:{torch.cuda.current_device()}"
    return device


def vote_device(device: str, gpu_share: float) -> str:
    """Where a pool's votes run: on the engine's device (NCCL on a GPU), except for a
    rank holding a fraction of a GPU, which votes over gloo (host memory): another rank
    of its group may share that GPU, and NCCL refuses a group with two ranks on one
    device. A vote is one integer a step, so gloo costs nothing that shows."""
    return "cpu" if device.startswith("cuda") and 0 < gpu_share < 1 else device


def assigned_gpu_share() -> float:
    """The GPUs Ray gave this actor (a fraction where ranks share one)."""
    import ray  # lazy: ray is heavy; a GPU rank is a Ray actor, CPU ranks never ask

    return float(ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0))


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def node_ip() -> str:
    try:
        import ray  # lazy: ray is heavy; outside Ray there is no node to ask

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


class GroupMember:
    """The group half of an engine rank (mixed into ``EngineRank``): it forms, pauses and
    re-forms the rank's data-parallel group and (re)starts the rank's loop on it.

    Uses the rank's ``engine``, ``engine_config``, ``pool_name``, ``_engine_lock``,
    ``_loop_factory``, ``_on_step``, ``_on_error`` and ``_fatal``."""

    pool_name = "normal"

    def _init_group(self, communicator_factory: Callable | None,
                    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
        self._comm_factory = communicator_factory or default_communicator_factory
        self.collective_timeout_s = collective_timeout_s
        self.group = GroupCommunicator()
        self.rank = 0
        self.world_size = 1
        self.generation = -1
        self.loop: Any = None
        self._comm: Any = None
        self._hosted_store: Any = None  # opened for the next group (rank 0 only)
        self._group_store: Any = None  # the store of the current group, if hosted here
        self._vote: _PausingCommunicator | None = None
        self._peers: list[Any] = []
        self._nonce = ""  # the current group's store nonce (never logged)

    def open_group_store(self) -> str:
        """Host the next group's rendezvous store (this rank becomes its rank 0) and
        return its tcp:// address.

        The store binds a port the OS picks and keeps it, so no other process can take
        the port between choosing it and listening on it (probing for a free port and
        binding it later failed with EADDRINUSE under parallel tests).

        What torch 2.13 allows, measured: ``TCPStore(host, 0, is_master=True)`` listens
        on every interface (``ss -ltn``: ``*:port``) whatever ``host`` says, with
        ``use_libuv`` True or False; given a socket bound here (``master_listen_fd``,
        ``dp_comm.listen_store``) it listens on the node's address only
        (``<ip>:port``) and owns the descriptor. The store has no authentication: any
        client that reaches the port may ``list_keys()`` (which shows the group's
        prefix, nonce included) and set, get, add, delete or wait on any key; raw garbage
        and idle half-open connections do not disturb it. So the router's per-group
        nonce only defeats guessed keys. The store is needed only while the group forms:
        ProcessGroupGloo's constructor swaps the ranks' addresses through it (keys
        ``<prefix>//0/<rank>``) and never reads it again (3 ranks ran 200 all-reduces
        after the server was destroyed), so once every rank joined, the router calls
        ``group_formed`` and this rank destroys it: nobody can connect any more. Not
        with ``TORCH_GLOO_LAZY_INIT=1`` (pairs connect at the first collective, through
        the store: measured, the all-reduce then fails, "Connection was likely
        closed"), and not for NCCL, whose communicators are created at the first
        collective (the ncclUniqueId goes through the store) and whose watchdog reads
        the store: there it stays open for the group's life (not measured: no GPUs
        here). What remains open: while a group forms (from here to ``group_formed``,
        normally well under a second, at most ``group_timeout_s``) a stranger who
        reaches the port can list the keys and overwrite a rank's address key, failing
        the formation (the pool retries with a new nonce) or pointing a rank's peer
        elsewhere; TCPStore cannot require a credential."""
        # lazy: engine.dp_comm imports torch; the router imports this module
        from pdserve.engine.dp_comm import listen_store

        host = node_ip()
        self._hosted_store = listen_store(host, 0, timeout=self.collective_timeout_s)
        shown = f"[{host}]" if ":" in host else host
        return f"tcp://{shown}:{self._hosted_store.port}"

    def join_group(self, rank: int, world_size: int, address: str | None, generation: int,
                   peers: list[Any], nonce: str = "") -> GroupJoined:
        """Form (or re-form) this rank's data-parallel group and (re)start its loop.

        ``nonce``: the router's random per-group value; it is part of the group's store
        prefix (``pdserve/{pool}/g{generation}/{nonce}``), so the store's keys cannot be
        guessed, and it is never logged (errors name the group without it).

        Bounded: the rendezvous gives up after `collective_timeout_s` (the caller also
        bounds the call)."""
        self.pause()
        self._close_group()
        self._group_store = None  # the previous group's, if it was still open
        device = device_name(self.engine_config.get("device"))
        if device.startswith("cuda"):
            device = vote_device(device, assigned_gpu_share())
        # Rank 0 hosts the store it opened in open_group_store, and joins as one more
        # client of it (like the others), so the server can be closed once the group
        # formed while the group's own store handle stays (see group_formed).
        hosted, self._hosted_store = self._hosted_store, None
        init: Any = address
        if hosted is not None and rank == 0 and address is not None:
            import torch.distributed as dist  # lazy: the router imports this module

            init = dist.TCPStore(hosted.host, hosted.port, None, False,
                                 timeout=datetime.timedelta(seconds=self.collective_timeout_s))
        name = f"pdserve/{self.pool_name}/g{generation}"
        self._nonce = nonce
        try:
            comm = self._comm_factory(rank, world_size, init, self.collective_timeout_s,
                                      f"{name}/{nonce}" if nonce else name, device=device,
                                      name=name)
        except Exception as exc:  # the store's errors may name its keys
            raise RuntimeError(f"forming {name} failed: {self._redact(error_text(exc))}") from None
        self._group_store = hosted  # kept until group_formed says the group has formed
        self._comm = comm
        self.group.group = comm
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self._peers = list(peers)
        self.engine.rank = rank
        self._vote = _PausingCommunicator(comm)
        self._loop_error = None
        if self._fatal is None:
            loop = self._loop_factory(self.engine, self._on_step, self._vote, self._on_error)
            loop.lock = self._engine_lock
            self.loop = loop.start() or loop
        return GroupJoined(rank, world_size, generation)

    def group_formed(self, generation: int) -> bool:
        """Every rank of group ``generation`` has joined: destroy the store this rank
        hosts for it if the group's backend never needs it again (gloo, without lazy
        init; see open_group_store). True if it was closed."""
        if generation != self.generation or self._group_store is None:
            return False
        if getattr(self._comm, "backend", None) != "gloo" or \
                os.environ.get("TORCH_GLOO_LAZY_INIT", "0").strip().lower() in ("1", "true"):
            return False
        self._group_store = None  # its last reference: the server stops listening now
        return True

    def _redact(self, text: str) -> str:
        return text.replace(self._nonce, "<nonce>") if self._nonce else text

    def pause(self, timeout_s: float = 30.0, dead_peer: str = "") -> bool:
        """Stop this rank's loop at a step boundary shared with its peers (at most
        `timeout_s`; then the thread is stopped where it is, between two steps).

        The pause vote reaches every rank in the same round; the controller calls
        `pause` on every rank (in parallel) so each one also stops its own thread.
        ``dead_peer`` (why a peer is known dead): no common boundary can be reached, so
        the group is aborted first; a vote waiting for the dead peer raises at once and
        the loop stops where it is (the step it was in ends as a failed step does).
        """
        loop, vote = self.loop, self._vote
        if dead_peer and self._comm is not None and hasattr(self._comm, "abort"):
            self._comm.abort(dead_peer)
        if loop is None:
            return True
        # A single rank votes with nobody: stopping its thread is a step boundary already.
        if vote is not None and loop.running and self.world_size > 1 and not dead_peer:
            vote.pause_requested = True
            loop.wake()
            deadline = time.monotonic() + timeout_s
            while loop.running and not vote.paused.is_set() and time.monotonic() < deadline:
                vote.paused.wait(0.05)
                loop.wake()
        loop.stop()
        self.loop = None
        return True

    def wake(self) -> None:
        if self.loop is not None:
            self.loop.wake()

    def _wake_pool(self) -> None:
        self.wake()
        for peer in self._peers:
            try:
                peer.wake.remote()
            except Exception:  # a dead peer is the controller's business
                pass

    def _close_group(self) -> None:
        if self._comm is not None and hasattr(self._comm, "close"):
            try:
                self._comm.close()
            except Exception:  # a broken group may refuse; it is dropped either way
                pass
