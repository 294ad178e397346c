"""A local control channel for the ``ray`` transport's one-node path: datagrams that ask
a decode rank to import a payload from shared memory, in place of a Ray actor call; all
sides.

Why: on one node the KV bytes already go through shared memory (shared_memory.py); what
is left is the ask. A Ray actor call round trip takes 1.4 ms idle here and 2-5 ms while
the router and both ranks are busy (2 cores), as long as the import of 16 MiB itself; a
datagram on a local socket wakes a thread that is already waiting in ~0.1 ms.

1. Listen (decode rank): ``WakeListener(on_wake, on_import)`` binds a datagram socket
   in Linux's abstract namespace under a random name (its ``address``, in the rank's
   ``RankInfo.wake_address``: nothing on disk, gone with the process) with
   ``SO_PASSCRED``; a thread waits on it. The kernel stamps each datagram with its
   sender's pid and uid: one from another user, larger than ``MAX_DATAGRAM_BYTES`` or
   malformed is dropped and counted (``num_refused``).
2. Import (router, ``LocalImports.request``): the locator, ``skip_blocks``, a reply
   address and a random id; the listener runs ``on_import`` (the same import as the
   Ray call ``ImportShared``, endpoint.py) and sends the result back. The router takes a
   reply only from the decode rank's pid and for an id it is waiting on. While it
   waits it watches the rank: a rank that dies fails the request at once (TRANSPORT),
   as the Ray call would. Nothing sent (no such listener, its queue full): ``None``,
   and the Ray call is made instead. The caller's deadline bounds the wait.
3. Wake (prefill rank, a direct hand-off, router/kv_stream.py 4): ``WakeSender.wake``
   sends the locator of a payload in the sender's own segment (a wake naming another
   process's is refused). With the router's reply address and an id it registered
   (``LocalImports.expect``, given to the prefill rank with its direct hand-off) the
   decode rank imports and answers the router as in 2, and the ticket carries a
   ``LocalReply``; nothing else crosses Ray. A wake without them (``on_wake``) is
   followed by the prefill rank's Ray call, which answers the router: ``ImportOnce``
   makes the two one import, whichever comes first (a wake after the call took its
   locator is ignored). A wake that could not be sent: the Ray call alone.

Nothing here copies KV: a datagram holds ~100 bytes of locator, the payload stays in
the prefill rank's segment. Linux only (``available``); elsewhere ranks get no wake
address and every ask is a Ray call.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.kv_transfer.base import PAYLOAD_MAX_AGE_S, TRANSPORT, DeliveryResult
from pdserve.kv_transfer.ray.shared_memory import SharedPayload, SharedPayloadUnavailable

log = logging.getLogger(__name__)

MAX_DATAGRAM_BYTES = 512  # an ask: op, locator, skip, reply address, id
MAX_REPLY_BYTES = 4096  # an answer: an ImportResult, its error cut to MAX_ERROR_CHARS
MAX_ERROR_CHARS = 2000
LISTEN_PREFIX = "\0pdserve-wake-"
REPLY_PREFIX = "\0pdserve-reply-"
REPLY_TRIES = 50  # ~50 ms of 1 ms waits for room in the router's queue
DEATH_CHECK_S = 0.05  # how often a waiting request looks at its rank's state
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
available = sys.platform.startswith("linux") and hasattr(socket, "SO_PASSCRED")


def _bound_socket(prefix: str) -> tuple[socket.socket, str]:
    """A datagram socket bound to a random abstract address (leading NUL: no file)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = prefix + secrets.token_hex(12)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock, address


def _sender(ancillary: list) -> tuple[int, int] | None:
    """(pid, uid) the kernel stamped the datagram with, or None."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS \
                and len(data) >= _CREDENTIALS.size:
            pid, uid, _ = _CREDENTIALS.unpack_from(data)
            return pid, uid
    return None


def _receive(sock: socket.socket, max_bytes: int, flags: int = 0) -> tuple[dict, int]:
    """One datagram from this user as a JSON object, and its sender's pid; raises
    SharedPayloadUnavailable for anything else, OSError when the socket is closed."""
    data, ancillary, msg_flags, _ = sock.recvmsg(max_bytes + 1,
                                                 socket.CMSG_SPACE(_CREDENTIALS.size), flags)
    if not data:  # also what a shut-down socket reads
        raise SharedPayloadUnavailable("an empty datagram")
    sender = _sender(ancillary)
    if sender is None or sender[1] != os.getuid():
        raise SharedPayloadUnavailable("a datagram from another user (or unstamped)")
    if len(data) > max_bytes or msg_flags & socket.MSG_TRUNC:
        raise SharedPayloadUnavailable(f"a datagram over {max_bytes} bytes")
    try:
        message = json.loads(data)
    except ValueError as exc:
        raise SharedPayloadUnavailable(f"not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise SharedPayloadUnavailable("not a JSON object")
    return message, sender[0]


def _encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


class WakeListener:
    """A decode rank's side: ``on_wake(locator)`` for a wake, ``on_import(locator,
    skip_blocks)`` (an ImportResult) for an import asked with a reply address."""

    def __init__(self, on_wake: Callable[[SharedPayload], Any],
                 on_import: Callable[[SharedPayload, int], Any] | None = None) -> None:
        if not available:
            raise OSError("wake channels need Linux (abstract unix sockets, SO_PASSCRED)")
        self._on_wake, self._on_import = on_wake, on_import
        self._sock, self.address = _bound_socket(LISTEN_PREFIX)
        self._closed = False
        self.num_woken = 0
        self.num_imports = 0
        self.num_refused = 0
        self._thread = threading.Thread(target=self._serve, name="kv-wake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                self._handle(*_receive(self._sock, MAX_DATAGRAM_BYTES))
            except SharedPayloadUnavailable as exc:
                if self._closed:
                    return
                self.num_refused += 1
                if self.num_refused == 1:
                    log.warning("refused a KV wake datagram: %s", exc)
            except OSError:
                return  # closed

    def _handle(self, message: dict, pid: int) -> None:
        """One datagram from process ``pid``; SharedPayloadUnavailable if it is refused."""
        op, locator = message.get("op"), SharedPayload.of(message.get("locator"))
        if op not in ("wake", "import"):
            raise SharedPayloadUnavailable(f"unknown op {str(op)[:40]!r}")
        if op == "wake" and locator.pid != pid:
            raise SharedPayloadUnavailable("a wake for another process's segment")
        if op == "wake" and "reply" not in message:  # a Ray call follows
            self.num_woken += 1
            self._call(self._on_wake, locator)
            return
        reply, rid, skip = _reply_fields(message)
        if self._on_import is None:
            raise SharedPayloadUnavailable("this rank takes no imports through the channel")
        if op == "wake":
            self.num_woken += 1
        else:
            self.num_imports += 1
        self._answer(reply, rid, self._call(self._on_import, locator, skip))

    @staticmethod
    def _call(fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # never the listener's end; the asker learns of it
            log.exception("a KV import asked through the wake channel raised")
            return DeliveryResult(False, kind=TRANSPORT, error=f"{type(exc).__name__}: {exc}")

    def _answer(self, reply: str, rid: str, result: Any) -> None:
        fields = asdict(result) if hasattr(result, "__dataclass_fields__") else {}
        answer = {"id": rid, "ok": bool(fields.get("ok")), "attempt": str(fields.get("attempt", "")),
                  "kind": str(fields.get("kind", "")),
                  "error": str(fields.get("error", ""))[:MAX_ERROR_CHARS],
                  "nbytes": int(fields.get("nbytes") or 0)}
        data = _encode(answer)
        # The router reads all the time, so its queue is full only if its loop is stuck:
        # retry briefly, never block the listener; a reply it never gets ends its wait
        # at its deadline, as a lost Ray reply would.
        for _ in range(REPLY_TRIES):
            try:
                self._sock.sendto(data, socket.MSG_DONTWAIT, reply)
                return
            except BlockingIOError:
                time.sleep(0.001)
            except OSError as exc:
                log.info("a KV import's reply could not be sent: %s", exc)
                return
        log.info("a KV import's reply could not be sent: the router's queue stayed full")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recvmsg
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        self._sock.close()


def _reply_fields(message: dict) -> tuple[str, str, int]:
    """An import's reply address, id and ``skip_blocks``, checked."""
    reply, rid, skip = message.get("reply"), message.get("id"), message.get("skip", 0)
    if not (isinstance(reply, str) and reply.startswith(REPLY_PREFIX)
            and isinstance(rid, str) and 0 < len(rid) <= 64
            and type(skip) is int and skip >= 0):
        raise SharedPayloadUnavailable("an import without a valid reply, id or skip")
    return reply, rid, skip


class WakeSender:
    """A prefill rank's side: one unbound socket, reused for every wake."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if available else None
        self._lock = threading.Lock()
        self.num_sent = 0
        self.num_failed = 0

    def wake(self, address: str, locator: SharedPayload, reply: str = "",
             reply_id: str = "") -> bool:
        """Ask for the import of ``locator`` (a segment of this process); with
        ``reply`` and ``reply_id`` (both or neither) the decode rank answers the router
        there. False when it could not be sent."""
        if self._sock is None or not address.startswith(LISTEN_PREFIX):
            return False
        fields: dict = {"op": "wake", "locator": list(locator.as_tuple())}
        if reply and reply_id:
            fields.update(reply=reply, id=reply_id)
        message = _encode(fields)
        try:
            with self._lock:
                self._sock.sendto(message, socket.MSG_DONTWAIT, address)
        except OSError:  # gone, or its queue is full: the Ray call imports
            self.num_failed += 1
            return False
        self.num_sent += 1
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


@dataclass(frozen=True)
class LocalReply:
    """A direct hand-off's answer is on its way to the router through its local channel
    (``LocalImports.answer(id)``), not as a Ray call's ObjectRef."""

    id: str


class LocalImports:
    """The router's side: imports asked of decode ranks on its node, answered by reply."""

    def __init__(self, max_pending: int = 65536, max_age_s: float = PAYLOAD_MAX_AGE_S) -> None:
        self._sock: socket.socket | None = None
        self.address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        # id -> (rank pid, answer, since): asked (request) or expected (expect)
        self._pending: dict[str, tuple[int, asyncio.Future, float]] = {}
        self.max_pending, self.max_age_s = max_pending, max_age_s
        self.num_requests = 0
        self.num_refused = 0

    def expect(self, rank_pid: int) -> str:
        """Register an answer the decode rank of process ``rank_pid`` will send when a
        prefill rank wakes it with this id (3 above); "" when the channel is not open.
        Call from the router's loop; ``answer`` waits for it, ``forget`` drops it."""
        loop = asyncio.get_running_loop()
        if not available or not self._ready(loop):
            return ""
        now = time.monotonic()
        for rid in [r for r, (_, _, since) in self._pending.items()
                    if now - since > self.max_age_s][:64]:
            self.forget(rid)
        if len(self._pending) >= self.max_pending:
            return ""
        rid = secrets.token_hex(16)
        self._pending[rid] = (int(rank_pid), loop.create_future(), now)
        return rid

    async def answer(self, rid: str, alive: Callable[[], bool]) -> DeliveryResult:
        """The answer registered as ``rid``, once it came (TRANSPORT at once if it is not
        registered, or when ``alive()`` turns False first); the caller bounds the wait."""
        try:
            entry = self._pending.get(rid)
            if entry is None:
                return DeliveryResult(False, kind=TRANSPORT,
                                      error="no local KV import answer is expected under that id")
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(entry[1]), DEATH_CHECK_S)
                except asyncio.TimeoutError:
                    if not alive():
                        return DeliveryResult(False, kind=TRANSPORT,
                                              error="the decode rank died during the import")
        finally:
            self._pending.pop(rid, None)

    def forget(self, rid: str) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None and not entry[1].done():  # one still waiting learns why
            entry[1].set_result(DeliveryResult(False, kind=TRANSPORT,
                                               error="the direct hand-off was called off"))

    async def request(self, address: str, locator: SharedPayload, skip_blocks: int,
                      rank_pid: int, alive: Callable[[], bool]) -> DeliveryResult | None:
        """The decode rank at ``address`` (process ``rank_pid``) imports ``locator``;
        its answer, or None when the ask could not be sent (make the Ray call). Waits
        until answered or ``alive()`` turns False; the caller bounds the wait."""
        if not available or not address.startswith(LISTEN_PREFIX):
            return None
        loop = asyncio.get_running_loop()
        if not self._ready(loop):
            return None
        rid = secrets.token_hex(16)
        self._pending[rid] = (int(rank_pid), loop.create_future(), time.monotonic())
        message = _encode({"op": "import", "locator": list(locator.as_tuple()),
                           "skip": int(skip_blocks), "reply": self.address, "id": rid})
        try:
            self._sock.sendto(message, socket.MSG_DONTWAIT, address)
        except OSError:
            self._pending.pop(rid, None)
            return None
        self.num_requests += 1
        return await self.answer(rid, alive)

    def _ready(self, loop: asyncio.AbstractEventLoop) -> bool:
        if self._loop is loop and self._sock is not None:
            return True
        self.close()
        try:
            self._sock, self.address = _bound_socket(REPLY_PREFIX)
            self._sock.setblocking(False)
            loop.add_reader(self._sock.fileno(), self._on_readable)
        except (OSError, NotImplementedError) as exc:
            log.warning("no local KV import channel (Ray calls only): %s", exc)
            self.close()
            return False
        self._loop = loop
        return True

    def _on_readable(self) -> None:
        while self._sock is not None:
            try:
                message, pid = _receive(self._sock, MAX_REPLY_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except SharedPayloadUnavailable:
                self.num_refused += 1
                continue
            except OSError:
                return
            waiting = self._pending.get(message.get("id")) if isinstance(message.get("id"), str) \
                else None
            if waiting is None or waiting[0] != pid:  # late, forged or from another process
                self.num_refused += 1
                continue
            try:
                result = DeliveryResult(
                    ok=message["ok"] is True, attempt=str(message.get("attempt", "")),
                    kind=str(message.get("kind", "")), error=str(message.get("error", "")),
                    nbytes=int(message.get("nbytes") or 0))
            except (KeyError, TypeError, ValueError):
                self.num_refused += 1
                continue
            if not waiting[1].done():
                waiting[1].set_result(result)

    def close(self) -> None:
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.remove_reader(self._sock.fileno())
                except Exception:
                    pass
            self._sock.close()
        self._sock, self._loop, self.address = None, None, ""
        for _, answer, _ in self._pending.values():
            if not answer.done():
                answer.set_result(DeliveryResult(False, kind=TRANSPORT,
                                                 error="the router's import channel closed"))


class _Entry:
    __slots__ = ("done", "result", "since")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.since = time.monotonic()


class ImportOnce:
    """One import per key, from whichever of two callers comes first (see 2 above)."""

    def __init__(self, max_entries: int = 1024, max_age_s: float = 60.0) -> None:
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._entries: dict[Hashable, _Entry] = {}
        self._taken: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_shared = 0  # imports a wake made that a call then answered

    def woken(self, key: Hashable, run: Callable[[], Any]) -> bool:
        """The wake's turn: run the import unless the call has (or is running) it."""
        with self._lock:
            if key in self._entries or key in self._taken:
                return False
            entry = self._entries[key] = _Entry()
            self._expire()
        try:
            entry.result = run()
        finally:
            entry.done.set()
        return True

    def called(self, key: Hashable, run: Callable[[], Any], timeout_s: float,
               on_timeout: Callable[[], Any]) -> Any:
        """The call's turn: the wake's result if it ran (waiting up to ``timeout_s`` for
        one in progress: ``on_timeout()`` past that), else run the import here."""
        with self._lock:
            entry = self._entries.get(key)
            self._taken[key] = None
            while len(self._taken) > self.max_entries:
                self._taken.popitem(last=False)
        if entry is None:
            return run()
        if not entry.done.wait(timeout_s):
            return on_timeout()
        with self._lock:
            self._entries.pop(key, None)
        self.num_shared += 1
        return entry.result

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        """Results nobody collected (the prefill rank died between its wake and its
        call): the import they made is an orphan the router aborts once it is reported."""
        cutoff = time.monotonic() - self.max_age_s
        for key in [k for k, e in self._entries.items() if e.done.is_set() and e.since < cutoff]:
            del self._entries[key]
        while len(self._entries) > self.max_entries:  # oldest finished first
            finished = [k for k, e in self._entries.items() if e.done.is_set()]
            if not finished:
                break
            del self._entries[finished[0]]
