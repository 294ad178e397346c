"""KV device to device over a torch.distributed pair group (NCCL send/recv); all sides.

Transport ``device``: for ranks that hold GPUs, the payload never leaves GPU memory on
its way. Each (prefill rank, decode rank) pair gets a process group of its own, two
ranks wide (the source is its rank 0), built directly on a ``PrefixStore`` as
engine/dp_comm.py builds the data-parallel groups (never the default group, which the
data-parallel votes use). Backend ``nccl`` when both ranks' engines are on CUDA, on two
different GPUs (NCCL refuses two ranks on one GPU: "Duplicate GPU detected"); ``gloo``
otherwise, so the whole path also runs on CPU ranks (and is tested there); a CUDA rank
in a gloo pair stages the bytes through host memory.

1. Export (prefill rank): ``DeviceEndpoint.payload_buffer`` lends a 1-D uint8 tensor on
   the engine's device, so a CUDA engine gathers its KV blocks straight into GPU memory
   (``PayloadLayout.write`` takes a tensor buffer); ``export`` keeps the tensor until it
   is released; the locator is the attempt key.
2. Pair group (router, on a pair's first delivery; cached on both ranks and in the
   router): the router asks the source to host a ``TCPStore`` bound to its node address
   only (``EngineRank.kv_pair_open``, ``dp_comm.listen_store``), then both ranks join
   concurrently (``kv_pair_join``) under the prefix ``pdserve/kv/<pair>/<nonce>``, with a
   fresh random nonce per group that is never logged (errors show ``<nonce>``). Every
   wait is bounded: the store and the group by ``form_timeout_s``, the router's calls by
   the same plus a margin, and a join that fails (a rank that died, say) ends the
   formation at once rather than after its peer's join gave up waiting. gloo needs the store only while the group forms: the source
   destroys the server at the pair's first send (both ranks joined by then); NCCL keeps
   it for the group's life (its communicator is made at the first send, through it).
3. Deliver (router): one transfer at a time per pair (so both sides issue their
   send/recv in the same order); the router calls the destination's ``kv_receive`` and
   the source's ``kv_send`` concurrently. The source first sends the payload's size
   (one int64; 0 when it no longer holds the payload, so the receiver never waits for
   bytes that will not come), then the payload; the receiver checks the size against
   the ticket, receives into a tensor on its device and imports from it
   (``EngineRank.import_prefilled``: the payload's tensors are views of the received
   tensor, scattered into the KV blocks with ``index_copy_``, device to device).
   ``skip_blocks``: the SOURCE cuts the prefix before sending (a device copy of the rest
   into a new payload), so the cached prefix never crosses the wire; the size message
   tells the receiver the cut size. Results: the import's own kind (``payload``,
   ``capacity``, ``cache_miss``); anything that kept the bytes from arriving (a peer dead
   or unreachable, a send or receive that failed or timed out, the payload gone) is
   ``transport``, and the pair group is dropped on both ranks (each closes it once its
   transfers on it ended) so the next delivery forms a new one.
4. Release / discard: the router tells the source (``release_kv``, through base.py's one
   release path and its deadline); it drops the tensor.
   An endpoint also forgets payloads nobody asked for within ``max_age_s``.

Copies of the KV bytes (``COPIES``; "wire" = NCCL's transfer, or gloo's socket):
- nccl (GPU to GPU): gather into the lent device tensor (1), wire (1), scatter into the
  receiver's blocks (1): 3, none of them through host memory. A cut prefix adds one
  device copy of the rest on the source.
- gloo, CPU ranks: gather (1), wire (1), scatter (1): 3.
- gloo, CUDA ranks on one GPU (or one CUDA, one CPU rank): gather (1), device to host
  (1), wire (1), host to device (1), scatter (1): 5.
A pair group left behind by a rank that died or left stays on its peer until the peer
drops the oldest (at most ``MAX_PAIRS`` per rank) or shuts down.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD,
    PAYLOAD_MAX_AGE_S,
    TRANSPORT,
    DeliveryResult,
    KVTransport,
    RankEndpoint,
)

log = logging.getLogger(__name__)

PREFIX = "pdserve/kv"
MAX_PAIRS = 64  # pair groups one rank keeps (the oldest idle one goes first)
COPIES = {"nccl, GPU to GPU": 3, "gloo, CPU ranks": 3, "gloo, staged through host memory": 5}
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# a cut payload's head may grow by one 64-byte alignment step; its tensors only shrink
_CUT_SLACK = 64


class PairUnavailable(RuntimeError):
    """No pair group by that name on this rank (never formed, dropped, or broken)."""


def pair_backend(src_info: Any, dst_info: Any) -> str:
    """``nccl`` when both ranks' engines are on CUDA, on two different GPUs; else ``gloo``."""
    src_dev = getattr(src_info, "device", "cpu") or "cpu"
    dst_dev = getattr(dst_info, "device", "cpu") or "cpu"
    if not (src_dev.startswith("cuda") and dst_dev.startswith("cuda")):
        return "gloo"
    a, b = getattr(src_info, "gpu_uuid", ""), getattr(dst_info, "gpu_uuid", "")
    return "nccl" if a and b and a != b else "gloo"


# ---------------------------------------------------------------------------------------
# The ranks' side.


@dataclass(eq=False)
class _Pair:
    name: str
    pg: Any
    backend: str
    rank: int  # 0: the source (sends), 1: the destination (receives)
    store: Any  # this rank's client of the group's store
    nonce: str = ""  # never shown: errors name the pair without it
    hosted: Any = None  # the source's store server, until gloo no longer needs it
    busy: int = 0
    dropped: bool = False
    broken: bool = False
    since: float = field(default_factory=time.monotonic)


class DeviceEndpoint(RankEndpoint):
    """A rank's side: lends device tensors for payloads (source), holds its pair groups
    (both), sends (source) and receives (destination) over them."""

    def __init__(self, device: str = "cpu", host: str = "127.0.0.1",
                 max_age_s: float = PAYLOAD_MAX_AGE_S, max_pairs: int = MAX_PAIRS) -> None:
        import torch

        super().__init__(max_age_s)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.host = host
        self.max_pairs = max_pairs
        self._pairs: dict[str, _Pair] = {}
        self._hosted: dict[str, Any] = {}  # pair -> store server, until the source joins
        self._lock = threading.Lock()

    # -- export ------------------------------------------------------------------------

    def payload_buffer(self, attempt: str, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # -- forming a pair ----------------------------------------------------------------

    def open_pair(self, pair: str, timeout_s: float) -> str:
        """Host pair ``pair``'s store on this node's address; its tcp:// address."""
        from pdserve.engine.dp_comm import listen_store

        store = listen_store(self.host, 0, timeout=timeout_s)
        with self._lock:
            self._hosted[pair] = store
            while len(self._hosted) > self.max_pairs:  # never joined: the oldest goes
                self._hosted.pop(next(iter(self._hosted)))
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{shown}:{store.port}"

    def join_pair(self, pair: str, address: str, rank: int, nonce: str, backend: str,
                  timeout_s: float) -> None:
        """Join pair ``pair``'s group as ``rank`` (0: source, 1: destination); returns
        once the group formed (gloo: both ranks connected), at most ``timeout_s``."""
        import torch.distributed as dist

        from pdserve.engine.dp_comm import _parse_tcp

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"pair backend must be gloo or nccl, got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("an nccl pair needs a rank on CUDA")
        with self._lock:
            hosted = self._hosted.pop(pair, None) if rank == 0 else None
        self.drop_pair(pair)  # a stale one of the same name
        host, port = _parse_tcp(address)
        td = datetime.timedelta(seconds=timeout_s)
        try:
            client = dist.TCPStore(host, port, None, False, timeout=td)
            store = dist.PrefixStore(f"{PREFIX}/{pair}/{nonce}/", client)
            if backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = td
                own = "127.0.0.1" if host in _LOOPBACK else self.host
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
                pg = dist.ProcessGroupGloo(store, rank, 2, opts)
            else:  # pragma: no cover - needs two GPUs
                opts = dist.ProcessGroupNCCL.Options()
                # past the rank's own deadline (see _wait), so the watchdog never fires first
                opts._timeout = datetime.timedelta(seconds=timeout_s + 600)
                opts.is_high_priority_stream = False
                pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        except Exception as exc:  # the store's errors may name its keys
            text = f"{type(exc).__name__}: {exc}".replace(nonce, "<nonce>")
            raise RuntimeError(f"forming KV pair group {pair} ({backend}) failed: {text}") from None
        entry = _Pair(pair, pg, backend, rank, client, nonce, hosted)
        with self._lock:
            self._pairs[pair] = entry
            evict = [p for p in self._pairs.values() if p.busy == 0 and p is not entry]
        for old in sorted(evict, key=lambda p: p.since)[:max(0, len(self._pairs) - self.max_pairs)]:
            self.drop_pair(old.name)

    def drop_pair(self, pair: str) -> bool:
        """Forget pair ``pair`` (closed now, or when its last transfer ends)."""
        with self._lock:
            self._hosted.pop(pair, None)
            entry = self._pairs.pop(pair, None)
            if entry is None:
                return False
            entry.dropped = True
            idle = entry.busy == 0
        if idle:
            _close(entry)
        return True

    def pairs(self) -> list[str]:
        with self._lock:
            return sorted(self._pairs)

    # -- moving a payload --------------------------------------------------------------

    def send(self, pair: str, attempt: str, skip_blocks: int, timeout_s: float) -> int:
        """Send ``attempt``'s payload (less its first ``skip_blocks`` blocks) to the
        pair's other rank: its size first, then its bytes. Returns the bytes sent."""
        import torch

        entry = self._take(pair)
        try:
            with _on_device(self.device):
                data, why = self.get(attempt), ""
                if data is None:
                    why = f"no KV payload for attempt {attempt!r} (released or expired)"
                else:
                    try:
                        if skip_blocks:
                            data = tensor_without_prefix(data, skip_blocks)
                        if entry.backend == "gloo" and data.device.type != "cpu":
                            data = data.cpu()  # staged through host memory
                    except Exception as exc:
                        why = f"preparing the payload failed: {type(exc).__name__}: {exc}"
                wire = torch.device("cpu") if entry.backend == "gloo" else self.device
                size = torch.tensor([0 if why else data.numel()], dtype=torch.int64, device=wire)
                self._wait(entry, entry.pg.send([size], 1, 0), timeout_s)
                if why:
                    raise RuntimeError(why)
                if entry.hosted is not None and entry.backend == "gloo" and \
                        os.environ.get("TORCH_GLOO_LAZY_INIT", "0").strip().lower() not in ("1", "true"):
                    entry.hosted = None  # both ranks joined: nobody can connect any more
                if data.numel():
                    self._wait(entry, entry.pg.send([data], 1, 0), timeout_s)
                return int(data.numel())
        except Exception as exc:
            raise _redacted(exc, entry) from None
        finally:
            self._done(entry)

    def receive(self, pair: str, nbytes: int, skip_blocks: int, timeout_s: float) -> Any:
        """Receive one payload from the pair's source: a uint8 tensor on this rank's device
        (``nbytes``: the ticket's size; a cut payload is announced smaller)."""
        import torch

        entry = self._take(pair)
        try:
            with _on_device(self.device):
                wire = torch.device("cpu") if entry.backend == "gloo" else self.device
                size = torch.zeros(1, dtype=torch.int64, device=wire)
                self._wait(entry, entry.pg.recv([size], 0, 0), timeout_s)
                n = int(size.item())
                if n <= 0:
                    raise RuntimeError("the source no longer holds the KV payload")
                if (n != nbytes) if not skip_blocks else (n > nbytes + _CUT_SLACK):
                    raise RuntimeError(f"the source announced {n} bytes, the ticket {nbytes}")
                data = torch.empty(n, dtype=torch.uint8, device=wire)
                self._wait(entry, entry.pg.recv([data], 0, 0), timeout_s)
                return data if data.device == self.device else data.to(self.device)
        except Exception as exc:
            raise _redacted(exc, entry) from None
        finally:
            self._done(entry)

    def _take(self, pair: str) -> _Pair:
        with self._lock:
            entry = self._pairs.get(pair)
            if entry is None:
                raise PairUnavailable(f"no KV pair group {pair!r} on this rank")
            entry.busy += 1
            return entry

    def _done(self, entry: _Pair) -> None:
        with self._lock:
            entry.busy -= 1
            close = entry.dropped and entry.busy == 0
        if close:
            _close(entry)

    def _wait(self, entry: _Pair, work: Any, timeout_s: float) -> None:
        try:
            if entry.backend == "gloo":
                work.wait(datetime.timedelta(seconds=timeout_s))
                return
            # NCCL: wait() only orders streams; poll for completion, bounded
            deadline = time.monotonic() + timeout_s  # pragma: no cover - needs two GPUs
            while not work.is_completed():  # pragma: no cover
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a KV transfer took longer than {timeout_s:g}s")
                time.sleep(0.0002)
            work.wait()  # pragma: no cover - the current stream now follows NCCL's
        except Exception:
            entry.broken = True  # gloo closes the pair on a timeout; either way it goes
            self.drop_pair(entry.name)
            raise

    def redact(self, text: str) -> str:
        """``text`` without any pair's nonce."""
        with self._lock:
            nonces = [p.nonce for p in self._pairs.values() if p.nonce]
        for nonce in nonces:
            text = text.replace(nonce, "<nonce>")
        return text

    def close(self) -> None:
        super().close()
        for pair in self.pairs():
            self.drop_pair(pair)
        with self._lock:
            self._hosted.clear()


def _redacted(exc: Exception, entry: _Pair) -> Exception:
    text = f"{exc}".replace(entry.nonce, "<nonce>") if entry.nonce else f"{exc}"
    return RuntimeError(text if type(exc) is RuntimeError else f"{type(exc).__name__}: {text}")


def _close(entry: _Pair) -> None:
    pg, entry.pg = entry.pg, None
    entry.hosted = entry.store = None
    if pg is None:
        return
    try:
        if entry.broken and hasattr(pg, "abort"):
            pg.abort()
        else:
            pg.shutdown()
    except Exception:  # a broken group may refuse a clean shutdown; dropped anyway
        pass


class _on_device:
    """``torch.cuda.device(device)`` for a CUDA device (the calling thread's current
    device is its own), nothing for the CPU."""

    def __init__(self, device: Any) -> None:
        self.ctx = None
        if device.type == "cuda":
            import torch

            self.ctx = torch.cuda.device(device)

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def tensor_without_prefix(data: Any, num_blocks: int) -> Any:
    """A payload tensor without its first ``num_blocks`` full blocks, as a new tensor on
    the same device (one device copy of the rest). One that cannot leave a prefix out (a
    sliding-window ring) goes whole: the receiver then finds no blocks skipped."""
    import torch

    from pdserve.engine.kv_payload import KVPayload, KVPayloadError

    try:
        payload = KVPayload.from_tensor(data).without_prefix(num_blocks)
    except KVPayloadError:
        return data
    layout = payload.layout({n: (t.dtype, tuple(t.shape)) for n, t in payload.tensors.items()})
    out = torch.empty(layout.nbytes, dtype=torch.uint8, device=data.device)
    for name, view in layout.write(out).items():
        view.copy_(payload.tensors[name])
    return out


# ---------------------------------------------------------------------------------------
# The router's side.


@dataclass(eq=False)
class _PairState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    name: str | None = None  # the formed group's name on both ranks; None: form one
    backend: str = ""


class DeviceTransport(KVTransport):
    """Deliver over each (source, destination) pair's own group; see the module doc."""

    name = "device"

    def __init__(self, timeout_s: float = 60.0, form_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.timeout_s = float(timeout_s)
        self.form_timeout_s = float(min(form_timeout_s, timeout_s))
        self._pairs: dict[tuple[Any, Any], _PairState] = {}
        self._serial = 0
        self.num_pairs_formed = 0
        self.num_pairs_dropped = 0

    async def deliver(self, ticket: Any, src: Any, dst: Any,
                      skip_blocks: int = 0) -> DeliveryResult:
        state = self._pairs.setdefault((_uid(src), _uid(dst)), _PairState())
        async with state.lock:  # one transfer per pair at a time: both sides in step
            if state.name is None:
                try:
                    await self._form(state, src, dst)
                except Exception as exc:
                    return DeliveryResult(False, kind=TRANSPORT,
                                          error=f"no KV pair group: {type(exc).__name__}: {exc}")
            name = state.name
            send = asyncio.ensure_future(_result(src.actor.kv_send.remote(
                name, ticket.attempt, skip_blocks, self.timeout_s)))
            recv = asyncio.ensure_future(_result(dst.actor.kv_receive.remote(
                name, ticket.nbytes, skip_blocks, self.timeout_s)))
            try:
                result = await self._outcome(send, recv)
            except asyncio.CancelledError:  # the router's bound: a half transfer, maybe
                self._drop(state, src, dst)
                raise
            finally:
                for task in (send, recv):
                    if not task.done():
                        task.cancel()
            if not result.ok and result.kind == TRANSPORT:
                self._drop(state, src, dst)
        if result.ok:
            self._delivered(result.nbytes)
        return result

    async def _outcome(self, send: asyncio.Future, recv: asyncio.Future) -> DeliveryResult:
        """Both sides' results as one; a side that failed ends the wait at once."""
        pending = {send, recv}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                res = task.result()
                if not res.ok and (task is send or res.kind == TRANSPORT):
                    side = "source" if task is send else "destination"
                    return DeliveryResult(False, kind=TRANSPORT, error=f"{side}: {res.error}")
        sent, got = send.result(), recv.result()
        if not got.ok:
            kind = got.kind if got.kind in (PAYLOAD, CAPACITY, CACHE_MISS) else PAYLOAD
            return DeliveryResult(False, kind=kind, error=got.error)
        return DeliveryResult(True, attempt=got.attempt, nbytes=sent.nbytes or got.nbytes)

    async def _form(self, state: _PairState, src: Any, dst: Any) -> None:
        backend = pair_backend(getattr(src, "info", None), getattr(dst, "info", None))
        self._serial += 1
        name = f"p{_uid(src)}-d{_uid(dst)}-{self._serial}"  # nothing secret in it
        nonce = secrets.token_hex(16)
        bound = self.form_timeout_s + 5.0
        try:
            address = await asyncio.wait_for(
                src.actor.kv_pair_open.remote(name, self.form_timeout_s), bound)
            await _joined([src.actor.kv_pair_join.remote(name, address, 0, nonce, backend,
                                                         self.form_timeout_s),
                           dst.actor.kv_pair_join.remote(name, address, 1, nonce, backend,
                                                         self.form_timeout_s)], bound)
        except BaseException as exc:  # a half-formed group goes on both ranks
            for actor in (src.actor, dst.actor):
                _fire(actor, name)
            if isinstance(exc, asyncio.CancelledError):
                raise
            text = f"{exc}".replace(nonce, "<nonce>")
            raise RuntimeError(text or f"{type(exc).__name__} after {bound:g}s") from None
        state.name, state.backend = name, backend
        self.num_pairs_formed += 1
        log.info("KV pair group %s formed (%s)", name, backend)

    def _drop(self, state: _PairState, src: Any, dst: Any) -> None:
        """Forget the pair's group here and on both ranks (not waited for)."""
        name, state.name = state.name, None
        if name is None:
            return
        self.num_pairs_dropped += 1
        for actor in (src.actor, dst.actor):
            _fire(actor, name)


async def _joined(joins: list[Any], bound: float) -> None:
    """Wait for both ranks' ``kv_pair_join``; raise once either failed. A side that
    failed (a rank dead, or unable to reach the store) ends the wait at once: its peer's
    join would only wait out ``form_timeout_s`` for a rank that is not coming, and the
    delivery (and the request behind it) with it. The peer's join then fails on its own
    rank within its bound, and the drop fired after this cleans it up."""
    pending = {asyncio.ensure_future(_join_error(j)) for j in joins}
    deadline = asyncio.get_running_loop().time() + bound
    try:
        while pending:
            left = deadline - asyncio.get_running_loop().time()
            done, pending = await asyncio.wait(pending, timeout=max(0.0, left),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise TimeoutError(f"the pair group did not form within {bound:g}s")
            errors = [e for e in (task.result() for task in done) if e]
            if errors:
                raise RuntimeError("; ".join(errors)[:2000])
    finally:
        for task in pending:
            task.cancel()


async def _join_error(ref: Any) -> str:
    """A ``kv_pair_join`` call's error text ("" once joined); a dead rank's too."""
    try:
        return await ref
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _uid(rank: Any) -> Any:
    uid = getattr(rank, "uid", None)
    return id(rank) if uid is None else uid


def _fire(actor: Any, name: str) -> None:
    try:
        actor.kv_pair_drop.remote(name)  # its result is not needed
    except Exception:  # a dead actor dropped it already
        pass


async def _result(ref: Any) -> Any:
    """An actor call's reply (the rank's ImportResult: ok, attempt, kind, error, nbytes);
    its failure (a dead actor) as a DeliveryResult with those same fields."""
    try:
        return await ref
    except Exception as exc:
        return DeliveryResult(False, kind=TRANSPORT, error=f"{type(exc).__name__}: {exc}")
