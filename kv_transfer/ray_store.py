"""KV through shared memory on one node, through Ray's object store across nodes; all sides.

1. Export (prefill rank): the engine gathers the payload's blocks straight into a
   shared-memory segment the rank's ``RayEndpoint`` lends it (``payload_buffer``; see
   shared_memory.py); the locator is a ``SharedPayload`` (pid, fd, inode, generation).
   A payload the staging area has no room for is ``ray.put`` as a uint8 array instead;
   its locator is the ObjectRef, owned by the prefill rank's process.
2. Deliver (router): a decode rank on the sender's node maps the segment and imports
   from it (``EngineRank.import_shared``), asked through its wake channel when the
   router shares that node too (a datagram with the locator, the answer back the same
   way; wake_channel.py), else by a Ray call with the locator as plain values. Any
   other decode rank, or one that cannot map it, gets an object the source makes of
   the bytes (``EngineRank.kv_object``) as an argument of ``import_prefilled``: Ray
   resolves it (node-to-node transfer across nodes; a read-only view of the shared
   store on one node). The router only ever holds the locator, never the bytes. A
   streamed prompt's hand-off may skip the router's ask: its prefill rank, told the
   stream's decode rank (``direct_handoff``, router/kv_stream.py), wakes that rank with
   the locator itself as it exports; the decode rank answers the router through the
   channel (``expect_direct`` / ``direct_answer``), or, without the router's reply
   address, the prefill rank's Ray call that follows (``direct_result``).
   ``skip_blocks``: on the shared path the receiver leaves the prefix out itself
   (nothing is copied for it); otherwise the source cuts it into the object it makes.
3. Import (decode rank): the payload's tensors are views of the mapped bytes; an import
   that finds room is scattered into its blocks at once; one that must wait takes a
   private copy first, since the segment is reused once the import is confirmed. After
   the copy the receiver checks the segment's generation again and refuses (TRANSPORT)
   an import whose bytes the sender reused meanwhile.
4. Release / discard: the router tells the source (``release_kv``, through base.py's one
   release path and its deadline) once the import is confirmed or the request ended;
   the segment is then reused for the next payload. An object-store payload goes when
   the router drops its last reference.

Copies of the KV bytes (``COPIES``):
- one node, shared memory: gather into the segment (1); scatter into the receiver's
  blocks (1): 2 in all (3 when the import must wait for room: a private copy).
- object store (across nodes, or no room to stage): gather (1); ``ray.put`` or the
  source's object of the staged bytes (1); Ray's transfer between nodes (1, none on one
  node); scatter (1).
If the prefill rank dies, its segments and objects go with it and the request is
re-prefilled elsewhere.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.kv_transfer import wake_channel
from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD,
    PAYLOAD_MAX_AGE_S,
    TRANSPORT,
    UNREACHABLE,
    DeliveryResult,
    KVTransport,
    RankEndpoint,
    payload_without_prefix,
)
from pdserve.kv_transfer.shared_memory import (
    SharedPayload,
    SharedPayloadReader,
    StagingArea,
)
from pdserve.kv_transfer.wake_channel import (
    LocalImports,
    LocalReply,
    WakeListener,
    WakeSender,
)

log = logging.getLogger(__name__)

# UNREACHABLE (base.FailureKind): what import_shared answers when it cannot map the
# sender's segment: use the object path
COPIES = {"shared memory (one node)": 2, "object store, one node": 3,
          "object store, across nodes": 4}


class RayEndpoint(RankEndpoint):
    """A rank's side: lends staging segments (sender), maps senders' ones (receiver)."""

    def __init__(self, staging_bytes: int = 0, max_age_s: float = PAYLOAD_MAX_AGE_S) -> None:
        super().__init__(max_age_s)
        self.staging = StagingArea(staging_bytes, _node_id(), max_age_s)
        self.reader = SharedPayloadReader()
        self.num_unstaged = 0  # payloads the staging area had no room for
        self._wakes: WakeListener | None = None  # a receiver's (listen_for_wakes)
        self._waker: WakeSender | None = None  # a sender's, made on its first wake

    # -- direct hand-offs' wake-ups (wake_channel.py) --------------------------------

    def listen_for_wakes(self, on_wake: Any, on_import: Any = None) -> str:
        """Receiver: call ``on_wake(locator)`` for every wake a sender on this node
        sends, ``on_import(locator, skip_blocks)`` for every import the router asks
        (wake_channel.py); the address to give them ("" where that is not available)."""
        if self._wakes is None and wake_channel.available:
            try:
                self._wakes = WakeListener(on_wake, on_import)
            except OSError as exc:
                log.warning("no KV wake channel (direct hand-offs use Ray calls only): %s", exc)
        return self._wakes.address if self._wakes is not None else ""

    @property
    def num_woken(self) -> int:
        return self._wakes.num_woken if self._wakes is not None else 0

    def wake(self, address: str, locator: Any, reply: str = "", reply_id: str = "") -> bool:
        """Sender: wake the receiver at ``address`` to import ``locator`` now (and answer
        the router at ``reply`` under ``reply_id``, when given)."""
        if not address or not isinstance(locator, SharedPayload):
            return False
        if self._waker is None:
            self._waker = WakeSender()
        return self._waker.wake(address, locator, reply, reply_id)

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
        import numpy as np
        import ray

        # As a uint8 array, not bytes: Ray hands an array to the receiver as a read-only
        # view of the shared object store (zero-copy on one node); bytes it copies out.
        return ray.put(np.frombuffer(payload, dtype=np.uint8))

    def object_for(self, attempt: str, skip_blocks: int = 0) -> Any:
        """A staged payload's bytes as an array, for a receiver that cannot map them
        (Ray copies the array into the object store as this returns)."""
        import numpy as np

        view = self.staging.view(attempt)
        if view is None:
            raise KeyError(f"no staged KV payload for attempt {attempt!r} (released or expired)")
        data = payload_without_prefix(view, skip_blocks) if skip_blocks else view
        return np.frombuffer(data, dtype=np.uint8)

    def open_shared(self, locator: SharedPayload | tuple) -> memoryview:
        """The payload's bytes, mapped read-only (``locator``: a SharedPayload or its
        ``as_tuple`` form, as ``deliver`` sends it); SharedPayloadUnavailable if not."""
        return self.reader.open(locator)

    def still_valid(self, locator: SharedPayload | tuple) -> bool:
        return self.reader.still_valid(locator)

    def release(self, attempt: str) -> None:
        self.staging.release(attempt)  # an object-store payload goes with the router's ref

    def forget_unexported(self) -> None:
        self.staging.forget_unexported()

    def __len__(self) -> int:
        return len(self.staging)

    def close(self) -> None:
        if self._wakes is not None:
            self._wakes.close()
        if self._waker is not None:
            self._waker.close()
        self.staging.close()
        self.reader.close()


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # outside a Ray worker: no node to share with
        return ""


class RayObjectStoreTransport(KVTransport):
    name = "ray"
    # a streamed prompt's prefill rank may ask its decode rank (same node) to import the
    # hand-off itself, before the router has the ticket (router/kv_stream.py)
    direct_handoff = True

    def __init__(self) -> None:
        super().__init__()
        self._local = LocalImports()  # asks decode ranks on this node (wake_channel.py)
        self._node = ""
        self.num_local_imports = 0  # deliveries asked through it, not by a Ray call

    def _on_this_node(self, node_id: str) -> bool:
        if not self._node:  # "" until Ray is up in this process
            self._node = _node_id()
        return bool(node_id) and node_id == self._node

    async def _import_local(self, locator: SharedPayload, dst: Any,
                            skip_blocks: int) -> DeliveryResult | None:
        """The import asked of ``dst`` through its wake channel, when it and this
        process share the payload's node; None: make the Ray call."""
        info = getattr(dst, "info", None)
        address = getattr(info, "wake_address", "") if info is not None else ""
        if not address or not self._on_this_node(locator.node_id):
            return None
        result = await self._local.request(
            address, locator, skip_blocks, int(getattr(info, "pid", 0) or 0),
            lambda: getattr(dst, "state", "") != "dead")
        if result is not None:
            self.num_local_imports += 1
        return result

    def expect_direct(self, src: Any, dst: Any) -> tuple[str, str]:
        """For a direct hand-off from ``src`` to ``dst``: (this router's reply address,
        an id) for the prefill rank's wake, so that the decode rank answers here and no
        Ray call is made; ("", "") unless all three share a node (wake_channel.py, 3).
        Call from the router's loop."""
        info, src_info = getattr(dst, "info", None), getattr(src, "info", None)
        address = getattr(info, "wake_address", "") if info is not None else ""
        node = getattr(info, "node_id", "") if info is not None else ""
        if not address or not self._on_this_node(node) \
                or getattr(src_info, "node_id", None) != node:
            return "", ""
        rid = self._local.expect(int(getattr(info, "pid", 0) or 0))
        return (self._local.address, rid) if rid else ("", "")

    async def direct_answer(self, reply: LocalReply, dst: Any, nbytes: int) -> DeliveryResult:
        """A direct hand-off's answer that comes through the local channel (the ticket's
        ``LocalReply``), as ``deliver`` would report it; the caller bounds the wait."""
        result = await self._local.answer(reply.id, lambda: getattr(dst, "state", "") != "dead")
        return self._as_delivery(result, nbytes, 0)

    def forget_direct(self, reply_id: str) -> None:
        """An expected answer nobody will wait for (the direct hand-off was called off)."""
        if reply_id:
            self._local.forget(reply_id)

    async def close(self) -> None:
        self._local.close()

    def direct_result(self, result: Any, nbytes: int) -> DeliveryResult:
        """A direct hand-off's ImportResult (what ``import_shared`` answered the prefill
        rank) as ``deliver`` would report it."""
        return self._as_delivery(result, nbytes, 0)

    async def deliver(self, ticket: Any, src: Any, dst: Any,
                      skip_blocks: int = 0) -> DeliveryResult:
        locator, nbytes = ticket.locator, ticket.nbytes
        try:
            result = None
            if isinstance(locator, SharedPayload):
                dst_node = getattr(getattr(dst, "info", None), "node_id", None)
                if locator.node_id and dst_node == locator.node_id:
                    result = await self._import_local(locator, dst, skip_blocks)
                    if result is None:  # as plain values: cheaper for Ray than the dataclass
                        result = await dst.actor.import_shared.remote(locator.as_tuple(),
                                                                      skip_blocks)
                    if not result.ok and result.kind == UNREACHABLE:
                        result = None
                if result is None:  # another node, or it could not map the segment
                    obj = src.actor.kv_object.remote(ticket.attempt, skip_blocks)
                    result = await dst.actor.import_prefilled.remote(obj)
            else:
                if skip_blocks:  # cut on the source, into a new object: the prefix stays there
                    locator = src.actor.kv_without_prefix.remote(ticket.locator, skip_blocks)
                result = await dst.actor.import_prefilled.remote(locator)
        except Exception as exc:  # the source died (payload lost) or the destination did
            return DeliveryResult(False, kind=TRANSPORT, error=f"{type(exc).__name__}: {exc}")
        return self._as_delivery(result, nbytes, skip_blocks)

    def _as_delivery(self, result: Any, nbytes: int, skip_blocks: int) -> DeliveryResult:
        if not result.ok:
            kind = result.kind if result.kind in (PAYLOAD, CAPACITY, CACHE_MISS, TRANSPORT) \
                else TRANSPORT if result.kind == UNREACHABLE else PAYLOAD
            return DeliveryResult(False, kind=kind, error=result.error)
        if skip_blocks:
            nbytes = result.nbytes or nbytes
        self._delivered(nbytes)
        return DeliveryResult(True, attempt=result.attempt, nbytes=nbytes)

    def held_key(self, ticket: Any) -> str | None:
        # An object goes with the router's last reference; a staged segment is the
        # source's to reuse, so it must be told (through the base's release path).
        return ticket.attempt if isinstance(ticket.locator, SharedPayload) else None
