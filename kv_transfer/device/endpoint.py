"""The ``device`` KV backend's rank side: payload tensors on the engine's device, the
rank's pair groups, and the sends and receives over them (see this package's
``__init__`` for the whole path)."""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv_transfer.base import (
    PAYLOAD,
    PAYLOAD_MAX_AGE_S,
    TRANSPORT,
    UNREACHABLE,
    DeliveryResult,
    RankEndpoint,
    RankHost,
    node_id,
)
from pdserve.kv_transfer.device import cuda_ipc
from pdserve.kv_transfer.device.calls import (
    DropPair,
    JoinPair,
    MapPayload,
    OpenPair,
    ReceivePayload,
    SendPayload,
    SharePayload,
)
from pdserve.kv_transfer.device.cuda_ipc import IpcHandle, IpcRefused

log = logging.getLogger(__name__)

PREFIX = "pdserve/kv"
MAX_PAIRS = 64  # pair groups one rank keeps (the oldest idle one goes first)
COPIES = {"cuda ipc, one node": 2, "nccl, GPU to GPU": 3, "gloo, CPU ranks": 3,
          "gloo, staged through host memory": 5}
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# a cut payload's head may grow by one 64-byte alignment step; its tensors only shrink
_CUT_SLACK = 64


class PairUnavailable(RuntimeError):
    """No pair group by that name on this rank (never formed, dropped, or broken)."""


def maps(src_info: Any, dst_info: Any) -> bool:
    """Whether a decode rank may map the prefill rank's payload by CUDA IPC: both on
    CUDA, on one node (the driver says whether it can, at the first map)."""
    devices = [getattr(i, "device", "cpu") or "cpu" for i in (src_info, dst_info)]
    nodes = {getattr(i, "node_id", None) for i in (src_info, dst_info)}
    return all(d.startswith("cuda") for d in devices) and len(nodes) == 1


def pair_backend(src_info: Any, dst_info: Any) -> str:
    """``nccl`` when both ranks' engines are on CUDA, on two different GPUs; else ``gloo``."""
    src_dev = getattr(src_info, "device", "cpu") or "cpu"
    dst_dev = getattr(dst_info, "device", "cpu") or "cpu"
    if not (src_dev.startswith("cuda") and dst_dev.startswith("cuda")):
        return "gloo"
    a, b = getattr(src_info, "gpu_uuid", ""), getattr(dst_info, "gpu_uuid", "")
    return "nccl" if a and b and a != b else "gloo"




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
                 max_age_s: float = PAYLOAD_MAX_AGE_S, max_pairs: int = MAX_PAIRS, *,
                 importer: RankHost | None = None, ipc: Any = cuda_ipc) -> None:
        # lazy: torch: the router's device transport imports this module
        import torch

        super().__init__(max_age_s)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.host = host  # the node address a hosted pair store binds
        self.importer = importer  # the rank a received payload is imported into
        self.max_pairs = max_pairs
        self._pairs: dict[str, _Pair] = {}
        self._hosted: dict[str, Any] = {}  # pair -> store server, until the source joins
        self._lock = threading.Lock()
        # CUDA IPC (``cuda_ipc``; a test double on CPU): share a payload, map a peer's
        self.ipc = ipc
        self.mapper = ipc.Mapper()
        self._cuts: dict[str, list[Any]] = {}  # attempt -> cut copies shared, until released
        self._where: tuple[str, str] | None = None  # (node, GPU uuid), once asked

    def calls(self) -> dict[type, Callable[..., Any]]:
        return {OpenPair: lambda c: self.open_pair(c.pair, c.timeout_s),
                JoinPair: self._join, SendPayload: self._send, ReceivePayload: self._receive,
                DropPair: lambda c: self.drop_pair(c.pair), SharePayload: self._share,
                MapPayload: self._map}

    # Each call below answers and never raises (a failure is a TRANSPORT result).

    def _join(self, call: JoinPair) -> str:
        try:
            self.join_pair(call.pair, call.address, call.rank, call.nonce, call.backend,
                           call.timeout_s)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}".replace(call.nonce, "<nonce>")
        return ""

    def _send(self, call: SendPayload) -> DeliveryResult:
        try:
            nbytes = self.send(call.pair, call.attempt, call.skip_blocks, call.timeout_s)
        except Exception as exc:
            return DeliveryResult(False, kind=TRANSPORT,
                                  error=self.redact(f"{type(exc).__name__}: {exc}"))
        return DeliveryResult(True, attempt=call.attempt, nbytes=nbytes)

    def _receive(self, call: ReceivePayload) -> DeliveryResult:
        """The payload into a tensor on this rank's device, then imported (the source cut
        any ``skip_blocks`` already)."""
        if self.importer is None:
            return DeliveryResult(False, kind=PAYLOAD, error="this rank imports no KV")
        try:
            data = self.receive(call.pair, call.nbytes, call.skip_blocks, call.timeout_s)
        except Exception as exc:
            return DeliveryResult(False, kind=TRANSPORT,
                                  error=self.redact(f"{type(exc).__name__}: {exc}"))
        return self.importer.import_prefilled(data)

    def _share(self, call: SharePayload) -> IpcHandle | DeliveryResult:
        """The payload's IPC handle; a cut copy is kept until the attempt is released."""
        data = self.get(call.attempt)
        if data is None:
            return DeliveryResult(False, kind=TRANSPORT, error=(
                f"no KV payload for attempt {call.attempt!r} (released or expired)"))
        try:
            with _on_device(self.device):
                if call.skip_blocks:
                    data = tensor_without_prefix(data, call.skip_blocks)
                    self._keep_cut(call.attempt, data)
                return self.ipc.share(data, *self.where())
        except IpcRefused as exc:
            return DeliveryResult(False, kind=UNREACHABLE, error=str(exc))
        except Exception as exc:
            return DeliveryResult(False, kind=TRANSPORT,
                                  error=f"sharing the payload failed: {type(exc).__name__}: {exc}")

    def _map(self, call: MapPayload) -> DeliveryResult:
        """Map a peer's shared payload, import it (copied into this rank's blocks), unmap."""
        if self.importer is None:
            return DeliveryResult(False, kind=PAYLOAD, error="this rank imports no KV")
        try:
            if not isinstance(call.handle, IpcHandle):
                raise ValueError(f"not an IPC handle: {type(call.handle).__name__}")
            call.handle.check(*self.where(), call.nbytes + (_CUT_SLACK if call.skip_blocks else 0))
            with self.mapper.mapped(call.handle, self.device) as data:
                return self.importer.import_prefilled(data, borrowed=True)
        except IpcRefused as exc:
            return DeliveryResult(False, kind=UNREACHABLE, error=str(exc))
        except Exception as exc:
            return DeliveryResult(False, kind=TRANSPORT,
                                  error=f"mapping the payload failed: {type(exc).__name__}: {exc}")

    def where(self) -> tuple[str, str]:
        """(node, GPU uuid) of this rank's device ("" off CUDA), as handles name them."""
        if self._where is None:
            self._where = (node_id(), self.ipc.gpu_uuid(self.device))
        return self._where

    def _keep_cut(self, attempt: str, data: Any) -> None:
        with self._payloads_lock:
            self._cuts = {a: c for a, c in self._cuts.items() if a in self._payloads}
            self._cuts.setdefault(attempt, []).append(data)

    def release(self, attempt: str) -> None:
        super().release(attempt)
        with self._payloads_lock:
            self._cuts.pop(attempt, None)

    def __len__(self) -> int:
        """Payloads and cut copies this rank holds for others (0 once all are released)."""
        with self._payloads_lock:
            return len(self._payloads) + sum(map(len, self._cuts.values()))

    # -- export ------------------------------------------------------------------------

    def payload_buffer(self, attempt: str, nbytes: int) -> Any:
        # lazy: torch: the router's device transport imports this module
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # -- forming a pair ----------------------------------------------------------------

    def open_pair(self, pair: str, timeout_s: float) -> str:
        """Host pair ``pair``'s store on this node's address; its tcp:// address."""
        # lazy: engine.dp_comm imports torch
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
        # lazy: torch: the router's device transport imports this module
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
        # lazy: torch: the router's device transport imports this module
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
        # lazy: torch: the router's device transport imports this module
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
        with self._payloads_lock:
            self._cuts.clear()
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
            # lazy: torch: the router's device transport imports this module
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
    # lazy: torch and engine.kv.payload: the router's device transport imports this module
    import torch

    from pdserve.engine.kv.payload import KVPayload, KVPayloadError

    try:
        payload = KVPayload.from_tensor(data).without_prefix(num_blocks)
    except KVPayloadError:
        return data
    layout = payload.layout({n: (t.dtype, tuple(t.shape)) for n, t in payload.tensors.items()})
    out = torch.empty(layout.nbytes, dtype=torch.uint8, device=data.device)
    for name, view in layout.write(out).items():
        view.copy_(payload.tensors[name])
    return out


