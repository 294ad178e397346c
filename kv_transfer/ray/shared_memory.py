"""Shared-memory segments for KV payloads between ranks on one node (the ``ray``
transport's fast path), both sides.

Why not the object store alone: ``ray.put`` copies the payload into the store at about
a third of memory speed here, and a fresh buffer costs page faults on every touch. A
prefill rank instead keeps a few anonymous shared-memory files (``memfd_create``),
reuses them warm, and gathers a payload's blocks straight into one; the decode rank
maps the same pages read-only and scatters from them straight into its blocks. The
bytes are copied twice in all, once on each side, and never pass through a socket.

1. Lend (sender): ``StagingArea.lend(attempt, nbytes)`` claims a free segment for the
   attempt (or makes one, within ``capacity_bytes``) and returns a writable view of its
   payload region; ``None`` when none fits (the caller uses its own buffer).
2. Export (sender): ``export(attempt)`` returns the picklable ``SharedPayload`` locator
   (pid, fd, inode, generation, length) once the payload is written.
3. Map (receiver): ``SharedPayloadReader.open(locator)`` (the locator, or its
   ``as_tuple`` form, which is cheaper to send through Ray) opens ``/proc/<pid>/fd/<fd>``
   (same user, same node), checks the inode and the generation and returns a
   read-only view; mappings are kept (bounded) so a segment reused for the next
   payload is mapped once. Anything unreachable raises ``SharedPayloadUnavailable``:
   the transport then falls back to the object store.
4. Release (sender): ``release(attempt)`` writes a new generation into the segment and
   makes it reusable. A reader checks the generation again after copying
   (``still_valid``): a copy that raced a reuse is refused, never imported.

A segment is freed when the sender closes it, or when its process dies (the kernel
frees an anonymous file with its last reference), so nothing outlives the ranks.
Linux only; elsewhere ``StagingArea.available`` is False and nothing is lent.
"""

from __future__ import annotations

import collections
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass

from pdserve.kv_transfer.base import PAYLOAD_MAX_AGE_S

HEADER_BYTES = 64  # generation (u64), then the payload from byte 64 (aligned)
MIN_SEGMENT_BYTES = 1 << 20
_GENERATION = struct.Struct("<Q")


def segment_size(need: int, capacity: int | None = None) -> int:
    """A new segment's size for ``need`` bytes: rounded up to a multiple of a
    sixteenth of the power of two above it (at least MIN_SEGMENT_BYTES), so that
    segments come in few sizes and can be reused for payloads of about the same size,
    yet waste at most an eighth (whole powers of two wasted up to half: a payload just
    over half the staging area, such as a prompt that fills its rank's KV cache, or a
    chunk just over 2 MiB, then took the object store's extra copies instead). One
    that rounding would take past ``capacity`` is rounded to pages only."""
    granule = max(1, (1 << (need - 1).bit_length()) // 16)
    size = max(MIN_SEGMENT_BYTES, -(-need // granule) * granule)
    if capacity is not None and size > capacity:
        size = max(MIN_SEGMENT_BYTES, -(-need // mmap.PAGESIZE) * mmap.PAGESIZE)
    return size


class SharedPayloadUnavailable(OSError):
    """The receiver cannot map the sender's segment (another node, another user, the
    sender gone, the segment reused)."""


@dataclass(frozen=True)
class SharedPayload:
    """Where one exported payload lies in its sender's shared memory."""

    node_id: str
    pid: int
    fd: int
    inode: int
    generation: int
    nbytes: int

    def as_tuple(self) -> tuple[str, int, int, int, int, int]:
        """The locator as plain values, for a Ray call (``SharedPayload.of`` reads it
        back): Ray packs those with msgpack, while a dataclass argument takes its pickle
        path, ~0.4 ms more per call here (a round trip of 1.8 ms instead of 1.4)."""
        return (self.node_id, self.pid, self.fd, self.inode, self.generation, self.nbytes)

    @classmethod
    def of(cls, value: object) -> SharedPayload:
        """``value`` as a locator: one already, or its ``as_tuple`` form (a list once
        msgpack has carried it); SharedPayloadUnavailable for anything else."""
        if isinstance(value, cls):
            return value
        if (isinstance(value, (tuple, list)) and len(value) == 6 and isinstance(value[0], str)
                and all(type(v) is int for v in value[1:])):
            return cls(*value)
        raise SharedPayloadUnavailable(f"not a shared payload locator: {type(value).__name__}")


class _Segment:
    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.inode = os.fstat(self.fd).st_ino
        self.generation = 0
        self.attempt: str | None = None
        self.nbytes = 0
        self.exported = False
        self.since = 0.0

    def bump(self) -> None:
        self.generation += 1
        _GENERATION.pack_into(self.map, 0, self.generation)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view still exists; the mapping goes with it
            pass
        os.close(self.fd)


class StagingArea:
    """A sender's reusable segments, at most ``capacity_bytes`` in all."""

    available = hasattr(os, "memfd_create")

    def __init__(self, capacity_bytes: int, node_id: str = "", max_age_s: float = PAYLOAD_MAX_AGE_S) -> None:
        self.capacity_bytes = capacity_bytes if self.available else 0
        self.node_id = node_id
        self.max_age_s = max_age_s
        self._segments: list[_Segment] = []
        self._by_attempt: dict[str, _Segment] = {}
        self._lock = threading.Lock()

    def lend(self, attempt: str, nbytes: int) -> memoryview | None:
        need = nbytes + HEADER_BYTES
        with self._lock:
            self._expire()
            if attempt in self._by_attempt:  # lent before but never exported: take it back
                self._free(self._by_attempt.pop(attempt))
            segment = self._take(need)
            if segment is None:
                return None
            segment.attempt, segment.nbytes, segment.exported = attempt, nbytes, False
            segment.since = time.monotonic()
            segment.bump()
            self._by_attempt[attempt] = segment
            return memoryview(segment.map)[HEADER_BYTES:HEADER_BYTES + nbytes]

    def export(self, attempt: str) -> SharedPayload | None:
        with self._lock:
            segment = self._by_attempt.get(attempt)
            if segment is None:
                return None
            segment.exported = True
            return SharedPayload(self.node_id, os.getpid(), segment.fd, segment.inode,
                                 segment.generation, segment.nbytes)

    def view(self, attempt: str) -> memoryview | None:
        """The exported payload's bytes, for a copy that must leave the node."""
        with self._lock:
            segment = self._by_attempt.get(attempt)
            if segment is None or not segment.exported:
                return None
            return memoryview(segment.map)[HEADER_BYTES:HEADER_BYTES + segment.nbytes]

    def release(self, attempt: str) -> bool:
        with self._lock:
            segment = self._by_attempt.pop(attempt, None)
            if segment is not None:
                self._free(segment)
            return segment is not None

    def forget_unexported(self) -> None:
        """Free what was lent for a payload that never got exported (its export failed)."""
        with self._lock:
            for attempt in [a for a, s in self._by_attempt.items() if not s.exported]:
                self._free(self._by_attempt.pop(attempt))

    def __len__(self) -> int:
        return len(self._by_attempt)

    @property
    def bytes_held(self) -> int:
        return sum(s.size for s in self._segments)

    def close(self) -> None:
        with self._lock:
            for segment in self._segments:
                segment.close()
            self._segments.clear()
            self._by_attempt.clear()

    # -- inside the lock -------------------------------------------------------------

    def _take(self, need: int) -> _Segment | None:
        free = [s for s in self._segments if s.attempt is None and need <= s.size <= 2 * need]
        if free:  # the smallest that fits; a much larger one stays for a larger payload
            return min(free, key=lambda s: s.size)
        size = segment_size(need, self.capacity_bytes)
        if size > self.capacity_bytes:
            return None
        while self.bytes_held + size > self.capacity_bytes:
            idle = [s for s in self._segments if s.attempt is None]
            if not idle:
                return None
            victim = max(idle, key=lambda s: s.size)
            self._segments.remove(victim)
            victim.close()
        try:
            segment = _Segment(size)
        except OSError:
            return None
        self._segments.append(segment)
        return segment

    def _free(self, segment: _Segment) -> None:
        segment.attempt, segment.exported = None, False
        segment.bump()  # a reader still holding the old locator now sees it changed

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.max_age_s
        for attempt in [a for a, s in self._by_attempt.items() if s.since < cutoff]:
            self._free(self._by_attempt.pop(attempt))


class SharedPayloadReader:
    """A receiver's mappings of senders' segments, at most ``max_mapped_bytes``."""

    def __init__(self, max_mapped_bytes: int = 4 << 30) -> None:
        self.max_mapped_bytes = max_mapped_bytes
        self._maps: collections.OrderedDict[tuple[int, int, int], mmap.mmap] = (
            collections.OrderedDict())
        self._lock = threading.Lock()

    def open(self, locator: SharedPayload | tuple) -> memoryview:
        locator = SharedPayload.of(locator)
        key = (locator.pid, locator.fd, locator.inode)
        with self._lock:
            segment = self._maps.get(key)
            if segment is None:
                segment = self._map(locator)
                self._maps[key] = segment
                self._trim()
            else:
                self._maps.move_to_end(key)
        if HEADER_BYTES + locator.nbytes > len(segment):
            raise SharedPayloadUnavailable(
                f"a payload of {locator.nbytes} bytes does not fit its segment of {len(segment)}")
        if not self._current(segment, locator):
            raise SharedPayloadUnavailable("the sender reused the segment (payload released)")
        return memoryview(segment)[HEADER_BYTES:HEADER_BYTES + locator.nbytes]

    def still_valid(self, locator: SharedPayload | tuple) -> bool:
        try:
            locator = SharedPayload.of(locator)
        except SharedPayloadUnavailable:
            return False
        with self._lock:
            segment = self._maps.get((locator.pid, locator.fd, locator.inode))
        return segment is not None and self._current(segment, locator)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()  # each mapping goes with its last view

    @staticmethod
    def _current(segment: mmap.mmap, locator: SharedPayload) -> bool:
        return _GENERATION.unpack_from(segment, 0)[0] == locator.generation

    @staticmethod
    def _map(locator: SharedPayload) -> mmap.mmap:
        try:
            fd = os.open(f"/proc/{int(locator.pid)}/fd/{int(locator.fd)}", os.O_RDONLY)
        except OSError as exc:
            raise SharedPayloadUnavailable(f"cannot open the sender's segment: {exc}") from exc
        try:
            info = os.fstat(fd)
            if info.st_ino != locator.inode:
                raise SharedPayloadUnavailable("the sender's descriptor names another file now")
            return mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            if isinstance(exc, SharedPayloadUnavailable):
                raise
            raise SharedPayloadUnavailable(f"cannot map the sender's segment: {exc}") from exc
        finally:
            os.close(fd)

    def _trim(self) -> None:
        while len(self._maps) > 1 and sum(len(m) for m in self._maps.values()) > self.max_mapped_bytes:
            self._maps.popitem(last=False)
