"""The ray backend's rank side: staging (sender), mapping and wake-ups (receiver).

A sender lends the engine staging segments for its payloads (``payload_buffer``),
exports a ``SharedPayload`` locator (or an object-store ref when there is no room),
makes an object of a staged payload for a receiver that cannot map it (``ObjectFor``),
cuts a prefix off an object-store payload (``WithoutPrefix``), and, told by the router
where a streamed attempt decodes (``HandOffTo``), wakes that decode rank with the
hand-off's locator as it exports (``hand_off_directly``). A receiver maps a sender's
segment and imports from it (``ImportShared``), asked by a Ray call, by the router's
local request, or by a sender's wake (wake_channel.py): one import per payload,
whichever comes first (``ImportOnce``).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
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
    payload_without_prefix,
)
from pdserve.kv_transfer.ray import wake_channel
from pdserve.kv_transfer.ray.calls import HandOffTo, ImportShared, ObjectFor, WithoutPrefix
from pdserve.kv_transfer.ray.shared_memory import (
    SharedPayload,
    SharedPayloadReader,
    SharedPayloadUnavailable,
    StagingArea,
)
from pdserve.kv_transfer.ray.wake_channel import (
    ImportOnce,
    LocalReply,
    WakeListener,
    WakeSender,
)

log = logging.getLogger(__name__)

# streamed attempts a sender keeps a direct hand-off's decode rank for (HandOffTo);
# bounded, oldest dropped (a dropped one is delivered by the router)
MAX_DIRECT_HANDOFFS = 4096
# how long a direct hand-off's Ray call waits for its wake's import in progress (that
# import waits for the engine between two steps; the router's deadline is its own)
WOKEN_IMPORT_WAIT_S = 30.0


class RayEndpoint(RankEndpoint):
    """A rank's side: lends staging segments (sender), maps senders' ones (receiver).

    ``importer``: the rank it serves (its ``import_prefilled`` and ``abort``); a sender alone
    may go without one."""

    def __init__(self, staging_bytes: int = 0, max_age_s: float = PAYLOAD_MAX_AGE_S, *,
                 importer: RankHost | None = None) -> None:
        super().__init__(max_age_s)
        self.importer = importer
        self.staging = StagingArea(staging_bytes, node_id(), max_age_s)
        self.reader = SharedPayloadReader()
        self.num_unstaged = 0  # payloads the staging area had no room for
        self._wakes: WakeListener | None = None  # a receiver's (listen_for_wakes)
        self._waker: WakeSender | None = None  # a sender's, made on its first wake
        self._once = ImportOnce()  # a receiver's: a wake's import or a call's, not both
        # sender: streamed attempt -> (decode actor, its wake address, the router's reply
        # address and id), as the router said (HandOffTo)
        self._direct_to: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._direct_lock = threading.Lock()

    def calls(self) -> dict[type, Callable[..., Any]]:
        return {ImportShared: lambda c: self.import_shared(c.locator, c.skip_blocks),
                ObjectFor: lambda c: self.object_for(c.attempt, c.skip_blocks),
                WithoutPrefix: lambda c, data: payload_without_prefix(data, c.num_blocks),
                HandOffTo: self._hand_off_to}

    # -- sender ----------------------------------------------------------------------

    def payload_buffer(self, attempt: str, nbytes: int) -> Any:
        lent = self.staging.lend(attempt, nbytes)
        if lent is not None:
            return lent
        self.num_unstaged += 1  # the object store's path: a copy more on this node
        if self.num_unstaged == 1:
            log.warning("a KV payload of %.1f MiB found no room in the staging area (%.0f MiB, "
                        "%.0f MiB held): it and any like it go through Ray's object store",
                        nbytes / 2**20, self.staging.capacity_bytes / 2**20,
                        self.staging.bytes_held / 2**20)
        return bytearray(nbytes)

    def export(self, attempt: str, payload: Any) -> Any:
        shared = self.staging.export(attempt)
        if shared is not None:
            return shared
        # lazy: numpy and ray, only when a payload goes through the object store
        import numpy as np
        import ray

        # As a uint8 array, not bytes: Ray hands an array to the receiver as a read-only
        # view of the shared object store (zero-copy on one node); bytes it copies out.
        return ray.put(np.frombuffer(payload, dtype=np.uint8))

    def object_for(self, attempt: str, skip_blocks: int = 0) -> Any:
        """A staged payload's bytes as an array, for a receiver that cannot map them
        (Ray copies the array into the object store as this returns)."""
        # lazy: numpy, only when a payload goes through the object store
        import numpy as np

        view = self.staging.view(attempt)
        if view is None:
            raise KeyError(f"no staged KV payload for attempt {attempt!r} (released or expired)")
        data = payload_without_prefix(view, skip_blocks) if skip_blocks else view
        return np.frombuffer(data, dtype=np.uint8)

    def release(self, attempt: str) -> None:
        self.staging.release(attempt)  # an object-store payload goes with the router's ref
        with self._direct_lock:  # a word that came after the export
            self._direct_to.pop(attempt, None)

    def forget_unexported(self) -> None:
        self.staging.forget_unexported()

    def __len__(self) -> int:
        return len(self.staging)

    # -- sender: the direct hand-off (router/kv_stream.py) ---------------------------

    def _hand_off_to(self, call: HandOffTo) -> None:
        """The router's word that the streamed attempt ``call.stream_of`` decodes on
        ``call.decode_actor`` (which holds its chunks): its hand-off's import is asked of
        that rank from here, as the payload is exported, instead of after the router has
        the ticket: through its wake channel when it has one (answering the router at
        ``reply_address`` under ``reply_id`` when given), else by a Ray call."""
        with self._direct_lock:
            if call.decode_actor is None:  # the router delivers it after all
                self._direct_to.pop(call.stream_of, None)
                return
            self._direct_to[call.stream_of] = (call.decode_actor, call.wake_address,
                                               call.reply_address, call.reply_id)
            self._direct_to.move_to_end(call.stream_of)
            while len(self._direct_to) > MAX_DIRECT_HANDOFFS:
                self._direct_to.popitem(last=False)

    def hand_off_directly(self, stream_of: str, locator: Any) -> Any:
        """A LocalReply (the decode rank answers the router itself), or the ObjectRef of
        the decode rank's ImportResult, or None (no word from the router, not staged in
        shared memory, or the call could not be made: the router delivers it)."""
        if not stream_of:
            return None
        with self._direct_lock:
            actor, wake_address, reply, reply_id = self._direct_to.pop(
                stream_of, (None, "", "", ""))
        if actor is None or not isinstance(locator, SharedPayload):
            return None
        # the wake starts the import now; with the router's reply id the decode rank
        # answers the router itself, else the call below does
        if self._wake(wake_address, locator, reply, reply_id) and reply and reply_id:
            return LocalReply(reply_id)
        try:
            return actor.kv_call.remote(ImportShared(locator.as_tuple(), 0))
        except Exception as exc:  # the decode rank is gone: the router finds another
            log.info("direct hand-off of %s not sent: %s", stream_of, type(exc).__name__)
            return None

    def _wake(self, address: str, locator: Any, reply: str = "", reply_id: str = "") -> bool:
        """Wake the receiver at ``address`` to import ``locator`` now (and answer the
        router at ``reply`` under ``reply_id``, when given)."""
        if not address or not isinstance(locator, SharedPayload):
            return False
        if self._waker is None:
            self._waker = WakeSender()
        return self._waker.wake(address, locator, reply, reply_id)

    # -- receiver --------------------------------------------------------------------

    def listen_for_wakes(self) -> str:
        """Import for every wake a sender on this node sends, and every import the router
        asks through the channel (wake_channel.py)."""
        if self._wakes is None and wake_channel.available:
            try:
                self._wakes = WakeListener(self._woken, self.import_shared)
            except OSError as exc:
                log.warning("no KV wake channel (direct hand-offs use Ray calls only): %s", exc)
        return self._wakes.address if self._wakes is not None else ""

    @property
    def num_woken(self) -> int:
        return self._wakes.num_woken if self._wakes is not None else 0

    def import_shared(self, locator: Any, skip_blocks: int = 0) -> DeliveryResult:
        """Map the sender's segment and import from it (``unreachable`` when it cannot be
        mapped). A payload a wake imported already (a direct hand-off) is answered with
        that import's result."""
        key = _locator_key(locator)
        if key is None or skip_blocks:
            return self._import_shared(locator, skip_blocks)
        return self._once.called(
            key, lambda: self._import_shared(locator, 0), WOKEN_IMPORT_WAIT_S,
            lambda: DeliveryResult(False, kind=TRANSPORT, error=(
                f"the woken import of this payload took over {WOKEN_IMPORT_WAIT_S:g}s")))

    def _woken(self, locator: Any) -> None:
        """A direct hand-off's wake (its Ray call, ``ImportShared``, follows)."""
        key = _locator_key(locator)
        if key is not None:
            self._once.woken(key, lambda: self._import_shared(locator, 0))

    def _import_shared(self, locator: Any, skip_blocks: int) -> DeliveryResult:
        if self.importer is None:
            return DeliveryResult(False, kind=PAYLOAD, error="this rank imports no KV")
        try:
            view = self.reader.open(locator)
        except SharedPayloadUnavailable as exc:
            return DeliveryResult(False, kind=UNREACHABLE, error=f"{type(exc).__name__}: {exc}")
        result = self.importer.import_prefilled(view, borrowed=True, skip_blocks=skip_blocks)
        del view
        # what it read (taken, or refused as malformed) is void if the sender reused it
        if (result.ok or result.kind == PAYLOAD) and not self.reader.still_valid(locator):
            if result.ok:
                self.importer.abort(result.attempt)
            return DeliveryResult(False, kind=TRANSPORT,
                                  error="the sender reused the KV segment while it was read")
        return result

    def open_shared(self, locator: SharedPayload | tuple) -> memoryview:
        """The payload's bytes, mapped read-only (``locator``: a SharedPayload or its
        ``as_tuple`` form); SharedPayloadUnavailable if not."""
        return self.reader.open(locator)

    def still_valid(self, locator: SharedPayload | tuple) -> bool:
        return self.reader.still_valid(locator)

    def close(self) -> None:
        if self._wakes is not None:
            self._wakes.close()
        if self._waker is not None:
            self._waker.close()
        self.staging.close()
        self.reader.close()


def _locator_key(locator: Any) -> tuple | None:
    """One shared payload's identity (a segment's generation changes with each payload
    it holds), or None for anything that is not a locator."""
    try:
        shared = SharedPayload.of(locator)
    except SharedPayloadUnavailable:
        return None
    return (shared.pid, shared.fd, shared.inode, shared.generation)
