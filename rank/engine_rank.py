"""The body every engine-rank actor shares (prefill, decode and normal workers).

One rank = one engine + one `EngineLoop` thread + (for world size > 1) a
`TorchDistCommunicator` to its pool peers, behind a `GroupCommunicator` the engine is
given when it is built. A request's life on a rank:

1. The router starts an attempt: `add_request(AddRequest)` (NORMAL / PROMPT) or
   `import_prefilled(payload)` (COMPLETION, through the KV transport's receive side).
   Admission runs under the engine lock between steps, then wakes this rank and its
   pool peers (lockstep: peers take empty steps while this rank works).
2. Each step's outputs become one typed `StepReport` (`rank/messages.py`); the router
   long-polls them (`poll`), so one Ray reply carries whole steps, never single tokens.
3. A PROMPT rank exports a finished prompt's KV through its transport endpoint and
   reports a `HandoffTicket`; the payload stays until the router releases it
   (`release_kv`), after the decode rank confirmed the import.
4. The attempt ends on the rank with a finish reason (or `abort` from the router); a
   step that raised ends its attempts with `error` (`step_failed`), and after
   `max_failed_steps` failed steps in a row the rank reports itself `fatal`.

Also:
- the data-parallel group is formed by `join_group` with an address the pool
  controller got from rank 0's `open_group_store` (rendezvous through Ray, no fixed
  port), and re-formed the same way after a resize or a dead peer: `pause` stops
  every rank of the pool at the same step boundary (a vote), then the next
  `join_group` starts a new loop with the new group. The store's keys carry a random
  nonce per group, and rank 0 closes the store once every rank joined (`group_formed`,
  gloo only; see `open_group_store` for what torch allows).
- the `grpc` KV endpoint authenticates every transfer with the cluster's `KVSecret`,
  given to the constructor by the router through Ray (see kv_transfer/grpc_bytes.py).
- the `device` KV transport gives each (prefill rank, decode rank) pair a two-rank
  torch.distributed group of its own (NCCL between GPUs, gloo otherwise), formed by the
  router on first use through `kv_pair_open` / `kv_pair_join` and used by `kv_send` /
  `kv_receive` (see kv_transfer/torch_dist.py); a prompt rank's engine then gathers its
  payloads into tensors on its own device.

Nothing here imports torch at module import time, so the router can reference the
actor classes without pulling torch into its process.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.engine.outputs import EngineStats, HandOff, RequestOutput, StepOutputs
from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD,
    TRANSPORT,
    UNREACHABLE,
    FailureKind,
    payload_without_prefix,
)
from pdserve.kv_transfer.wake_channel import ImportOnce
from pdserve.rank.messages import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_MAX_FAILED_STEPS,
    DEFAULT_POLL_TIMEOUT_S,
    AddRequest,
    AdmitResult,
    GroupJoined,
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
# streamed attempts a PROMPT rank keeps a direct hand-off's decode rank for (hand_off_to)
MAX_DIRECT_HANDOFFS = 4096

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
        from pdserve.scheduler.votes import SingleRankCommunicator

        self.group: Any = SingleRankCommunicator()

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def all_reduce_min(self, value: int) -> int:
        return self.group.all_reduce_min(value)


def default_engine_factory(config: dict, communicator: Any) -> Any:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(**config), communicator=communicator)


def default_loop_factory(engine: Any, on_step: Callable, communicator: Any,
                         on_error: Callable) -> Any:
    from pdserve.engine.engine_loop import EngineLoop

    return EngineLoop(engine, on_step=on_step, communicator=communicator,
                      park_timeout_s=0.5, on_error=on_error)


def default_communicator_factory(rank: int, world_size: int, address: Any,
                                 timeout_s: float, prefix: str, device: str | None = None,
                                 name: str | None = None) -> Any:
    """``address``: the group store's tcp:// address, or (rank 0) a client of the store
    it hosts. ``prefix`` holds the group's nonce; ``name`` is what errors may show."""
    from pdserve.engine.dp_comm import TorchDistCommunicator

    # The backend follows the device: NCCL for ranks on a GPU, gloo on CPU.
    return TorchDistCommunicator(rank, world_size, address, timeout=timeout_s, prefix=prefix,
                                 device=device, name=name)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _refused_kind(exc: BaseException) -> FailureKind:
    """Why the engine refused an import, by the type it raised: no room (CAPACITY), a
    left-out prefix its cache lost (CACHE_MISS), else the payload itself (PAYLOAD)."""
    from pdserve.engine.engine import CacheMissError, NoCapacityError  # loaded with the engine

    if isinstance(exc, NoCapacityError):
        return CAPACITY
    if isinstance(exc, CacheMissError):
        return CACHE_MISS
    return PAYLOAD


class EngineRank:
    """One rank of a pool; wrapped by the Ray actor classes of the worker packages."""

    pool_name = "normal"
    engine_type = "normal"

    def __init__(self, engine_config: dict, *, engine_factory: Callable | None = None,
                 loop_factory: Callable | None = None,
                 communicator_factory: Callable | None = None,
                 kv_transport: str = "ray",
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
                 num_threads: int | None = None,
                 max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS,
                 kv_secret: Any = None) -> None:
        """``kv_secret``: the cluster's ``KVSecret`` (the router's, through Ray), which the
        ``grpc`` KV endpoint checks every transfer against; held by the endpoint only."""
        from pdserve.kv_transfer import make_endpoint

        config = dict(engine_config)
        config["engine_type"] = self.engine_type
        self.engine_config = config
        self._engine_factory = engine_factory or default_engine_factory
        self._loop_factory = loop_factory or default_loop_factory
        self._comm_factory = communicator_factory or default_communicator_factory
        self.kv_transport = kv_transport
        self.collective_timeout_s = collective_timeout_s
        self.max_failed_steps = max_failed_steps
        if num_threads:
            # Ray sets OMP_NUM_THREADS=1 in actors; choose torch's threads on purpose.
            import torch

            torch.set_num_threads(num_threads)
        self.group = GroupCommunicator()
        self.engine = self._engine_factory(config, self.group)
        self.rank = 0
        self.world_size = 1
        self.generation = -1
        self.loop: Any = None
        self._comm: Any = None
        self._hosted_store: Any = None  # opened for the next group (rank 0 only)
        self._group_store: Any = None  # the store of the current group, if hosted here
        self._vote: _PausingCommunicator | None = None
        self._peers: list[Any] = []
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
        self._imported_at: dict[str, float] = {}  # attempt -> monotonic time taken
        # PROMPT: streamed attempt -> the decode rank its hand-off goes to directly
        # (hand_off_to); bounded, oldest dropped (a dropped one is delivered by the router)
        self._direct_to: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._direct_lock = threading.Lock()
        self._nonce = ""  # the current group's store nonce (never logged)
        self.endpoint = make_endpoint(
            kv_transport, self, _node_ip(), secret=kv_secret,
            max_push_bytes=self.max_kv_payload_bytes() if kv_transport == "grpc" else None,
            staging_bytes=self.kv_staging_bytes(),
            device=self.kv_device() if kv_transport == "device" else None)
        if self.engine_type == "prompt" and hasattr(self.engine, "payload_buffer"):
            self.engine.payload_buffer = self.endpoint.payload_buffer
        self.kv_address: str | None = self.endpoint.address
        # COMPLETION, ray: imports asked through the wake channel (kv_transfer/
        # wake_channel.py) by the router, or by a direct hand-off's wake and its Ray
        # call, one import per payload, whichever comes first
        self._once = ImportOnce()
        self.wake_address = ""
        if self.engine_type == "completion" and hasattr(self.endpoint, "listen_for_wakes"):
            self.wake_address = self.endpoint.listen_for_wakes(self._woken, self.import_shared)

    def __repr__(self) -> str:  # Ray shows it; nothing secret in it
        # Ray calls it while reporting a failed __init__ too: never raise here.
        pool, rank = getattr(self, "pool_name", "?"), getattr(self, "rank", "?")
        return f"{type(self).__name__}(pool={pool}, rank={rank}, pid={os.getpid()})"

    def max_kv_payload_bytes(self) -> int | None:
        """The largest KV payload this rank could ever import: the longest sequence its KV
        blocks (and the model length) allow, plus its header (None: the engine does not
        say; the transport's default cap applies)."""
        eng = self.engine
        cache = getattr(getattr(eng, "runner", None), "kv_cache", None)
        if cache is None or not hasattr(cache, "bytes_per_block"):
            return None
        from pdserve.kv_transfer.grpc_bytes import max_payload_bytes

        block_size = int(cache.block_size)
        tokens = min(int(eng.max_model_len), int(cache.num_blocks) * block_size)
        blocks = -(-tokens // block_size)
        ring = cache.ring_bytes() // max(1, int(cache.num_state_slots))
        return max_payload_bytes(tokens, blocks * cache.bytes_per_block() + ring)

    def kv_device(self) -> str:
        """Where this rank's KV cache lives ("cpu", "cuda:0"; the configured device when
        the engine does not say)."""
        cache = getattr(getattr(self.engine, "runner", None), "kv_cache", None)
        device = getattr(cache, "device", None)
        if device is not None:
            return str(device)
        device = self.engine_config.get("device") or "cpu"
        if device == "cuda":
            import torch

            device = f"cuda:{torch.cuda.current_device()}"
        return str(device)

    def kv_staging_bytes(self) -> int:
        """Shared memory a PROMPT rank may keep for payloads on their way: what its KV
        cache holds, plus room for the payloads' headers (8 bytes a token id: a long
        prompt's streamed chunks each carry the ids so far) and segments' rounding (at
        most an eighth); payloads beyond that go through the object store. Only what is
        used is ever allocated."""
        cache = getattr(getattr(self.engine, "runner", None), "kv_cache", None)
        if self.engine_type != "prompt" or cache is None or not hasattr(cache, "bytes_per_block"):
            return 0
        kv = int(cache.num_blocks) * cache.bytes_per_block() + cache.ring_bytes()
        return kv + kv // 4 + (16 << 20)

    # -- identity and rendezvous -----------------------------------------------------

    def info(self) -> RankInfo:
        eng = self.engine
        tok = eng.tokenizer
        stats = self.stats()
        node_id = ""
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # not inside Ray (unit tests)
            pass
        device, gpu_uuid = self.kv_device(), ""
        if device.startswith("cuda"):
            import torch

            try:
                gpu_uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
            except Exception:  # unknown: the device transport then stays on gloo
                pass
        return RankInfo(
            pool=self.pool_name, engine_type=self.engine_type, pid=os.getpid(), node_id=node_id,
            host=_node_ip(), max_model_len=int(eng.max_model_len),
            vocab_size=int(getattr(getattr(eng, "runner", None), "vocab_size", None)
                           or tok.vocab_size),
            eos_token_id=tok.eos_token_id, block_size=int(self.engine_config.get("block_size", DEFAULT_BLOCK_SIZE)),
            num_total_blocks=stats.num_total_blocks, kv_address=self.kv_address,
            device=device, gpu_uuid=gpu_uuid, wake_address=self.wake_address)

    def ping(self) -> int:
        """Answers at once (no engine lock): the controller's liveness check."""
        return os.getpid()

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
        from pdserve.engine.dp_comm import listen_store

        host = _node_ip()
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
        if self._comm is not None and hasattr(self._comm, "close"):
            try:
                self._comm.close()
            except Exception:  # a broken group may refuse; it is dropped either way
                pass
        self._group_store = None  # the previous group's, if it was still open
        device = self.engine_config.get("device") or "cpu"
        if device == "cuda":
            import torch

            device = f"cuda:{torch.cuda.current_device()}"
        # Rank 0 hosts the store it opened in open_group_store, and joins as one more
        # client of it (like the others), so the server can be closed once the group
        # formed while the group's own store handle stays (see group_formed).
        hosted, self._hosted_store = self._hosted_store, None
        init: Any = address
        if hosted is not None and rank == 0 and address is not None:
            import datetime

            import torch.distributed as dist

            init = dist.TCPStore(hosted.host, hosted.port, None, False,
                                 timeout=datetime.timedelta(seconds=self.collective_timeout_s))
        name = f"pdserve/{self.pool_name}/g{generation}"
        self._nonce = nonce
        try:
            comm = self._comm_factory(rank, world_size, init, self.collective_timeout_s,
                                      f"{name}/{nonce}" if nonce else name, device=device,
                                      name=name)
        except Exception as exc:  # the store's errors may name its keys
            raise RuntimeError(f"forming {name} failed: {self._redact(_error_text(exc))}") from None
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

    def pause(self, timeout_s: float = 30.0) -> bool:
        """Stop this rank's loop at a step boundary shared with its peers (at most
        `timeout_s`; then the thread is stopped where it is, between two steps).

        The pause vote reaches every rank in the same round; the controller calls
        `pause` on every rank (in parallel) so each one also stops its own thread.
        """
        loop, vote = self.loop, self._vote
        if loop is None:
            return True
        # A single rank votes with nobody: stopping its thread is a step boundary already.
        if vote is not None and loop.running and self.world_size > 1:
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
                stream_kv=request.stream_kv))
        except (ValueError, TypeError, RuntimeError) as exc:
            return AdmitResult(False, _error_text(exc))
        return AdmitResult(True)

    def import_prefilled(self, payload: Any, *, borrowed: bool = False,
                         skip_blocks: int = 0) -> ImportResult:
        """The receive side of every transport: check the payload whole, then queue it
        (see ``LLMEngine.import_prefilled`` for ``borrowed`` and ``skip_blocks``)."""
        start = time.time()
        try:
            attempt = self._call(lambda eng: eng.import_prefilled(
                payload, borrowed=borrowed, skip_blocks=skip_blocks))
        except Exception as exc:
            return ImportResult(False, kind=_refused_kind(exc), error=_error_text(exc))
        self._imported_at[attempt] = time.monotonic()
        self.timeline.imported(self.pool_name, self.rank, start, time.time())
        nbytes = len(payload)
        if skip_blocks:  # the prefix it left out was never read
            cache = self.engine.runner.kv_cache
            nbytes = max(0, nbytes - skip_blocks * cache.bytes_per_block())
        return ImportResult(True, attempt=attempt, nbytes=nbytes)

    def import_shared(self, locator: Any, skip_blocks: int = 0) -> ImportResult:
        """The ray transport's receive side on one node: map the sender's segment and
        import from it (answers ``unreachable`` when it cannot be mapped). A payload a
        wake imported already (a direct hand-off) is answered with that import's result."""
        key = _locator_key(locator)
        if key is None or skip_blocks:
            return self._import_shared(locator, skip_blocks)
        return self._once.called(
            key, lambda: self._import_shared(locator, 0), WOKEN_IMPORT_WAIT_S,
            lambda: ImportResult(False, kind=TRANSPORT, error=(
                f"the woken import of this payload took over {WOKEN_IMPORT_WAIT_S:g}s")))

    def _woken(self, locator: Any) -> None:
        """A direct hand-off's wake (its Ray call, import_shared, follows)."""
        key = _locator_key(locator)
        if key is not None:
            self._once.woken(key, lambda: self._import_shared(locator, 0))

    def _import_shared(self, locator: Any, skip_blocks: int) -> ImportResult:
        from pdserve.kv_transfer.shared_memory import SharedPayloadUnavailable

        try:
            view = self.endpoint.open_shared(locator)
        except (SharedPayloadUnavailable, AttributeError) as exc:
            return ImportResult(False, kind=UNREACHABLE, error=_error_text(exc))
        result = self.import_prefilled(view, borrowed=True, skip_blocks=skip_blocks)
        del view
        # what it read (taken, or refused as malformed) is void if the sender reused it
        if (result.ok or result.kind == PAYLOAD) and not self.endpoint.still_valid(locator):
            if result.ok:
                self.abort(result.attempt)
            return ImportResult(False, kind=TRANSPORT,
                                error="the sender reused the KV segment while it was read")
        return result

    def kv_object(self, attempt: str, skip_blocks: int = 0) -> Any:
        """The ray transport's object path for a staged payload (another node)."""
        return self.endpoint.object_for(attempt, skip_blocks)

    def kv_without_prefix(self, payload: bytes, num_blocks: int) -> bytes:
        """The ray transport's cut (``deliver(..., skip_blocks)``): this rank's payload
        without the prefix the receiver's cache holds, as a new object."""
        return payload_without_prefix(payload, num_blocks)

    # The device transport (kv_transfer/torch_dist.py): a pair group per (prefill rank,
    # decode rank), formed by the router on first use (this rank hosts its store when it
    # is the source: kv_pair_open; both join: kv_pair_join), then one kv_send on the
    # source and one kv_receive on the destination per payload, called concurrently.
    # Each answers an ImportResult and never raises (a failure is kind TRANSPORT).

    def kv_pair_open(self, pair: str, timeout_s: float) -> str:
        """Source: host pair ``pair``'s store on this node; its tcp:// address."""
        return self.endpoint.open_pair(pair, timeout_s)

    def kv_pair_join(self, pair: str, address: str, rank: int, nonce: str, backend: str,
                     timeout_s: float) -> str:
        """Join pair ``pair``'s group (rank 0: source, 1: destination); "" once formed,
        else what failed (the nonce never shown)."""
        try:
            self.endpoint.join_pair(pair, address, rank, nonce, backend, timeout_s)
        except Exception as exc:
            return _error_text(exc).replace(nonce, "<nonce>")
        return ""

    def kv_send(self, pair: str, attempt: str, skip_blocks: int, timeout_s: float) -> ImportResult:
        """Source: send ``attempt``'s payload over pair ``pair`` (its first ``skip_blocks``
        blocks cut off here first); ``nbytes``: what crossed."""
        try:
            nbytes = self.endpoint.send(pair, attempt, skip_blocks, timeout_s)
        except Exception as exc:
            return ImportResult(False, kind=TRANSPORT,
                                error=self.endpoint.redact(_error_text(exc)))
        return ImportResult(True, attempt=attempt, nbytes=nbytes)

    def kv_receive(self, pair: str, nbytes: int, skip_blocks: int,
                   timeout_s: float) -> ImportResult:
        """Destination: receive one payload over pair ``pair`` (a tensor on this rank's
        device) and import it (the source cut any ``skip_blocks`` already)."""
        try:
            data = self.endpoint.receive(pair, nbytes, skip_blocks, timeout_s)
        except Exception as exc:
            return ImportResult(False, kind=TRANSPORT,
                                error=self.endpoint.redact(_error_text(exc)))
        return self.import_prefilled(data)

    def kv_pair_drop(self, pair: str) -> bool:
        """Forget pair ``pair``'s group (closed once its transfers ended)."""
        return self.endpoint.drop_pair(pair)

    def hand_off_to(self, stream_of: str, decode_actor: Any, wake_address: str = "",
                    reply_address: str = "", reply_id: str = "") -> None:
        """The router's word that the streamed attempt ``stream_of`` decodes on
        ``decode_actor`` (which holds its chunks): its hand-off's import is asked of that
        rank from here, as the payload is exported, instead of after the router has the
        ticket (router/kv_stream.py, direct hand-off): through its wake channel at
        ``wake_address`` when it has one, answering the router at ``reply_address``
        under ``reply_id`` when given, else by a Ray call (kv_transfer/wake_channel.py)."""
        with self._direct_lock:
            if decode_actor is None:  # the router delivers it after all
                self._direct_to.pop(stream_of, None)
                return
            self._direct_to[stream_of] = (decode_actor, str(wake_address or ""),
                                          str(reply_address or ""), str(reply_id or ""))
            self._direct_to.move_to_end(stream_of)
            while len(self._direct_to) > MAX_DIRECT_HANDOFFS:
                self._direct_to.popitem(last=False)

    def _direct_import(self, stream_of: str, locator: Any) -> Any:
        """Ask the stream's decode rank to import the payload at ``locator`` now; where
        its answer goes to the router (a LocalReply, or the ObjectRef of a Ray call's
        ImportResult), or None (no word from the router, not staged in shared memory, or
        the call could not be made: the router delivers it)."""
        from pdserve.kv_transfer.shared_memory import SharedPayload
        from pdserve.kv_transfer.wake_channel import LocalReply

        if not stream_of:
            return None
        with self._direct_lock:
            actor, wake_address, reply, reply_id = self._direct_to.pop(
                stream_of, (None, "", "", ""))
        if actor is None or not isinstance(locator, SharedPayload):
            return None
        # the wake starts the import now; with the router's reply id the decode rank
        # answers the router itself, else the call below does
        if self.endpoint.wake(wake_address, locator, reply, reply_id) and reply and reply_id:
            return LocalReply(reply_id)
        try:
            return actor.import_shared.remote(locator.as_tuple(), 0)
        except Exception as exc:  # the decode rank is gone: the router finds another
            log.info("direct hand-off of %s not sent: %s", stream_of, type(exc).__name__)
            return None

    def abort(self, attempt: str) -> bool:
        self.endpoint.release(attempt)
        self._imported_at.pop(attempt, None)
        with self._direct_lock:
            self._direct_to.pop(attempt, None)
        return bool(self._call(lambda eng: eng.abort(attempt)))

    # -- reporting -------------------------------------------------------------------

    def _on_step(self, out: StepOutputs) -> None:
        end = time.time()
        self._count_failures(out)
        if not out.outputs and not out.handoffs and not out.cache_events and not out.kv_chunks:
            self.timeline.step(self.pool_name, self.rank, out, end)
            return
        hs = time.time() if out.handoffs else 0.0
        kv_chunks = [KVChunkTicket.of(c, self.endpoint.export(c.key, c.payload))
                     for c in out.kv_chunks]
        handoffs = [self._export(h) for h in out.handoffs]
        self.endpoint.forget_unexported()  # what a failed export was lent
        self.timeline.step(self.pool_name, self.rank, out, end, hs, time.time() if hs else 0.0)
        report = StepReport.of(out, handoffs, kv_chunks)
        if self.engine_type == "normal" or self._imported_at:
            self._add_timings(out, report.outputs)
        with self._cond:
            self._reports.append(report)
            self._cond.notify_all()

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

    def _add_timings(self, out: StepOutputs, entries: list[TokenReport]) -> None:
        """Durations on this rank's clock for the router's TTFT breakdown: a decode
        rank's wait from taking a payload to its first decode step; a normal rank's
        prefill queue and prefill, on the output that carries the first token."""
        step_start = time.monotonic() - out.duration_s
        for o, entry in zip(out.outputs, entries, strict=True):
            taken = self._imported_at.pop(o.request_id, None) if self._imported_at else None
            if taken is not None:
                entry.timings = RankTimings(
                    decode_queue_s=max(0.0, step_start - taken),
                    kv_imported_wall=time.time() - (time.monotonic() - taken))
            elif o.new_token_ids and o.num_output_tokens == len(o.new_token_ids):
                entry.timings = _prefill_timings(o)

    def _export(self, handoff: HandOff) -> HandoffTicket:
        locator = self.endpoint.export(handoff.request_id, handoff.payload)
        timings = _prefill_timings(handoff)
        if timings is not None:
            timings.kv_export_s = max(0.0, time.monotonic() - handoff.first_token_time)
            timings.kv_ready_wall = time.time() - timings.kv_export_s
        return HandoffTicket.of(handoff, locator, timings,
                                direct_import=self._direct_import(handoff.stream_of, locator))

    def _on_error(self, exc: BaseException) -> None:
        self._loop_error = self._redact(_error_text(exc))
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
        stats = dataclasses.replace(
            st, rank=self.rank, num_woken_imports=int(getattr(self.endpoint, "num_woken", 0)))
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

    # -- KV transport endpoint ---------------------------------------------------------

    def release_kv(self, attempt: str) -> None:
        self.endpoint.release(attempt)
        with self._direct_lock:  # a word that came after the export
            self._direct_to.pop(attempt, None)

    def release_kv_many(self, attempts: list[str]) -> None:
        for attempt in attempts:
            self.endpoint.release(attempt)

    def shutdown(self) -> None:
        self.pause(timeout_s=2.0)
        self.endpoint.close()
        if self._comm is not None and hasattr(self._comm, "close"):
            try:
                self._comm.close()
            except Exception:
                pass


# how long a direct hand-off's Ray call waits for its wake's import in progress (that
# import waits for the engine between two steps; the router's deadline is its own)
WOKEN_IMPORT_WAIT_S = 30.0


def _locator_key(locator: Any) -> tuple | None:
    """One shared payload's identity (a segment's generation changes with each payload
    it holds), or None for anything that is not a locator."""
    from pdserve.kv_transfer.shared_memory import SharedPayload, SharedPayloadUnavailable

    try:
        shared = SharedPayload.of(locator)
    except SharedPayloadUnavailable:
        return None
    return (shared.pid, shared.fd, shared.inode, shared.generation)


def _prefill_timings(x: RequestOutput | HandOff) -> RankTimings | None:
    """Prefill queue and compute, in seconds, from a RequestOutput's or HandOff's
    engine-clock times (None when the engine did not record them)."""
    if x.first_scheduled_time is None or x.first_token_time is None:
        return None
    return RankTimings(prefill_queue_s=max(0.0, x.first_scheduled_time - x.arrival_time),
                       prefill_s=max(0.0, x.first_token_time - x.first_scheduled_time))


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
