"""The ``device`` KV backend's router side: forms each (source, destination) pair's
group on its first delivery and runs each transfer's send and receive together (see
this package's ``__init__`` for the whole path)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD,
    TRANSPORT,
    UNREACHABLE,
    DeliveryResult,
    KVTransport,
)
from pdserve.kv_transfer.device.calls import (
    DropPair,
    JoinPair,
    MapPayload,
    OpenPair,
    ReceivePayload,
    SendPayload,
    SharePayload,
)
from pdserve.kv_transfer.device.cuda_ipc import IpcHandle
from pdserve.kv_transfer.device.endpoint import maps, pair_backend

log = logging.getLogger(__name__)



@dataclass(eq=False)
class _PairState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    name: str | None = None  # the formed group's name on both ranks; None: form one
    backend: str = ""
    unmappable: bool = False  # CUDA IPC was refused between these two ranks


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
        self.num_mapped = 0  # deliveries by CUDA IPC
        self.num_map_refusals = 0  # pairs whose CUDA IPC the driver refused

    async def deliver(self, ticket: Any, src: Any, dst: Any,
                      skip_blocks: int = 0) -> DeliveryResult:
        state = self._pairs.setdefault((_uid(src), _uid(dst)), _PairState())
        if not state.unmappable and maps(getattr(src, "info", None), getattr(dst, "info", None)):
            result = await self._map(ticket, src, dst, skip_blocks)
            if result.kind != UNREACHABLE:
                if result.ok:
                    self.num_mapped += 1
                    self._delivered(result.nbytes)
                return result
            state.unmappable = True  # asked once per pair: the pair group carries the rest
            self.num_map_refusals += 1
            log.warning("CUDA IPC between ranks %s and %s refused (%s); their KV goes "
                        "through a pair group", _uid(src), _uid(dst), result.error)
        return await self._send(state, ticket, src, dst, skip_blocks)

    def delivery_paths(self) -> dict[str, int]:
        return {"cuda_ipc": self.num_mapped, "pair_group": self.num_deliveries - self.num_mapped}

    async def _map(self, ticket: Any, src: Any, dst: Any, skip_blocks: int) -> DeliveryResult:
        """The source shares the payload's device memory, the destination maps it and
        copies it into its blocks; the source keeps it until released, as ever."""
        bound = self.timeout_s + 5.0
        shared = await _bounded(src.actor.kv_call.remote(
            SharePayload(ticket.key, skip_blocks)), bound, "source")
        if not isinstance(shared, IpcHandle):
            kind = UNREACHABLE if shared.kind == UNREACHABLE else TRANSPORT
            return DeliveryResult(False, kind=kind, error=f"source: {shared.error}")
        got = await _bounded(dst.actor.kv_call.remote(
            MapPayload(shared, ticket.nbytes, skip_blocks)), bound, "destination")
        if got.ok:
            return DeliveryResult(True, attempt=got.attempt, nbytes=shared.nbytes)
        known = (PAYLOAD, CAPACITY, CACHE_MISS, TRANSPORT, UNREACHABLE)
        return DeliveryResult(False, kind=got.kind if got.kind in known else PAYLOAD,
                              error=got.error)

    async def _send(self, state: _PairState, ticket: Any, src: Any, dst: Any,
                    skip_blocks: int) -> DeliveryResult:
        """Over the pair's group (formed on its first delivery)."""
        async with state.lock:  # one transfer per pair at a time: both sides in step
            if state.name is None:
                try:
                    await self._form(state, src, dst)
                except Exception as exc:
                    return DeliveryResult(False, kind=TRANSPORT,
                                          error=f"no KV pair group: {type(exc).__name__}: {exc}")
            name = state.name
            send = asyncio.ensure_future(_result(src.actor.kv_call.remote(
                SendPayload(name, ticket.key, skip_blocks, self.timeout_s))))
            recv = asyncio.ensure_future(_result(dst.actor.kv_call.remote(
                ReceivePayload(name, ticket.nbytes, skip_blocks, self.timeout_s))))
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
                src.actor.kv_call.remote(OpenPair(name, self.form_timeout_s)), bound)
            await _joined([actor.kv_call.remote(JoinPair(name, address, rank, nonce, backend,
                                                         self.form_timeout_s))
                           for rank, actor in enumerate((src.actor, dst.actor))], bound)
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
    """Wait for both ranks' ``JoinPair``; raise once either failed. A side that
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
    """A ``JoinPair`` call's error text ("" once joined); a dead rank's too."""
    try:
        return await ref
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _uid(rank: Any) -> Any:
    uid = getattr(rank, "uid", None)
    return id(rank) if uid is None else uid


def _fire(actor: Any, name: str) -> None:
    try:
        actor.kv_call.remote(DropPair(name))  # its result is not needed
    except Exception:  # a dead actor dropped it already
        pass


async def _bounded(ref: Any, bound: float, side: str) -> Any:
    """``_result`` within ``bound`` seconds (past it: a TRANSPORT failure)."""
    try:
        return await asyncio.wait_for(_result(ref), bound)
    except asyncio.TimeoutError:
        return DeliveryResult(False, kind=TRANSPORT, error=f"the {side} gave no answer "
                                                           f"within {bound:g}s")


async def _result(ref: Any) -> Any:
    """An actor call's reply (the rank's ImportResult: ok, attempt, kind, error, nbytes);
    its failure (a dead actor) as a DeliveryResult with those same fields."""
    try:
        return await ref
    except Exception as exc:
        return DeliveryResult(False, kind=TRANSPORT, error=f"{type(exc).__name__}: {exc}")
