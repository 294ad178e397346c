"""A direct hand-off's wake-up, from a prefill rank to a decode rank on one node (the
``ray`` transport's fast path); both sides.

Why: a direct hand-off (router/kv_stream.py, 4) has the prefill rank ask its decode
rank for the import as it exports the payload. As a Ray actor call that ask took 1.5-5
ms to start running on the decode rank here (2 cores, the router and both ranks busy
with the first token), a third of what a 4k-token prompt's first-to-second-token gap
had left. One datagram on a local socket wakes a thread that is already waiting: ~0.1
ms. The Ray call is still made, right after: it is how the router learns the answer
(``HandoffTicket.direct_import``), and it imports by itself whenever the wake did not
arrive (another node, the socket gone, a full queue).

1. Listen (decode rank): ``WakeListener(on_wake)`` binds a datagram socket in Linux's
   abstract namespace under a random name (``address``: nothing on disk, gone with the
   process) with ``SO_PASSCRED``, and a thread waits on it.
2. Wake (prefill rank): ``WakeSender.wake(address, locator)`` sends the payload's
   ``SharedPayload`` locator (as JSON, one datagram) without blocking; False when it
   could not (no such listener, its queue full), and then the Ray call imports.
3. Take (decode rank): the kernel stamps each datagram with its sender's pid and uid.
   A datagram from another user, naming a segment of a process other than its sender,
   larger than ``MAX_DATAGRAM_BYTES`` or not a locator is dropped and counted
   (``num_refused``); the rest go to ``on_wake(locator)``.
4. Once (decode rank): ``ImportOnce`` runs the import of one locator once, whichever of
   the wake and the Ray call (``EngineRank.import_shared``) comes first; the Ray call
   waits for a wake's import in progress and answers its result. A wake that comes after
   the Ray call took its locator is ignored. Entries nobody collects (the prefill rank
   died between its wake and its call) go after ``max_age_s``; the import they made is
   an orphan the router aborts when the decode rank reports it.

Nothing here copies KV: the locator is ~80 bytes, the payload stays in the prefill
rank's segment. Linux only (``available``); elsewhere ranks get no wake address and the
Ray call does it all.
"""

from __future__ import annotations

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
from typing import Any

from pdserve.kv_transfer.shared_memory import SharedPayload, SharedPayloadUnavailable

log = logging.getLogger(__name__)

MAX_DATAGRAM_BYTES = 512
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
available = sys.platform.startswith("linux") and hasattr(socket, "SO_PASSCRED")


def _encode(locator: SharedPayload) -> bytes:
    return json.dumps(list(locator.as_tuple()), separators=(",", ":")).encode()


def _decode(data: bytes) -> SharedPayload:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise SharedPayloadUnavailable(f"not JSON: {exc}") from exc
    return SharedPayload.of(value)


def _sender(ancillary: list) -> tuple[int, int] | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS \
                and len(data) >= _CREDENTIALS.size:
            pid, uid, _ = _CREDENTIALS.unpack_from(data)
            return pid, uid
    return None


class WakeListener:
    """A decode rank's side: ``on_wake(locator)`` on its own thread per valid datagram."""

    def __init__(self, on_wake: Callable[[SharedPayload], Any]) -> None:
        if not available:
            raise OSError("wake channels need Linux (abstract unix sockets, SO_PASSCRED)")
        self._on_wake = on_wake
        # the leading NUL puts it in the abstract namespace: no file, no cleanup
        self.address = "\0pdserve-wake-" + secrets.token_hex(12)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._sock.bind(self.address)
        except BaseException:
            self._sock.close()
            raise
        self._uid = os.getuid()
        self._closed = False
        self.num_woken = 0
        self.num_refused = 0
        self._thread = threading.Thread(target=self._serve, name="kv-wake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        space = socket.CMSG_SPACE(_CREDENTIALS.size)
        while not self._closed:
            try:
                data, ancillary, flags, _ = self._sock.recvmsg(MAX_DATAGRAM_BYTES + 1, space)
            except OSError:
                return  # closed
            if self._closed:
                return
            sender = _sender(ancillary)
            try:
                if sender is None or sender[1] != self._uid:
                    raise SharedPayloadUnavailable("a datagram from another user (or unstamped)")
                if len(data) > MAX_DATAGRAM_BYTES or flags & socket.MSG_TRUNC:
                    raise SharedPayloadUnavailable(f"a datagram over {MAX_DATAGRAM_BYTES} bytes")
                locator = _decode(data)
                if locator.pid != sender[0]:
                    raise SharedPayloadUnavailable("a wake for another process's segment")
            except SharedPayloadUnavailable as exc:
                self.num_refused += 1
                if self.num_refused == 1:
                    log.warning("refused a KV wake datagram: %s", exc)
                continue
            self.num_woken += 1
            try:
                self._on_wake(locator)
            except Exception:  # the Ray call imports instead, and says what went wrong
                log.exception("a woken KV import raised")

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


class WakeSender:
    """A prefill rank's side: one unbound socket, reused for every wake."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if available else None
        self._lock = threading.Lock()
        self.num_sent = 0
        self.num_failed = 0

    def wake(self, address: str, locator: SharedPayload) -> bool:
        if self._sock is None or not address.startswith("\0pdserve-wake-"):
            return False
        try:
            with self._lock:
                self._sock.sendto(_encode(locator), socket.MSG_DONTWAIT, address)
        except OSError:  # gone, or its queue is full: the Ray call imports
            self.num_failed += 1
            return False
        self.num_sent += 1
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


class _Entry:
    __slots__ = ("done", "result", "since")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.since = time.monotonic()


class ImportOnce:
    """One import per key, from whichever of two callers comes first (see 4 above)."""

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
        cutoff = time.monotonic() - self.max_age_s
        for key in [k for k, e in self._entries.items() if e.done.is_set() and e.since < cutoff]:
            del self._entries[key]
        while len(self._entries) > self.max_entries:  # oldest finished first
            finished = [k for k, e in self._entries.items() if e.done.is_set()]
            if not finished:
                break
            del self._entries[finished[0]]
