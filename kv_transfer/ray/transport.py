"""KV through shared memory on one node, through Ray's object store across nodes: the
router's side (the rank's is endpoint.py, their calls calls.py).

1. Export (prefill rank): the engine gathers the payload's blocks straight into a
   shared-memory segment the rank's ``RayEndpoint`` lends it (``payload_buffer``; see
   shared_memory.py); the locator is a ``SharedPayload`` (pid, fd, inode, generation).
   A payload the staging area has no room for is ``ray.put`` as a uint8 array instead;
   its locator is the ObjectRef, owned by the prefill rank's process.
2. Deliver (router): a decode rank on the sender's node maps the segment and imports
   from it (``ImportShared``, calls.py, answered by endpoint.py), asked through its
   wake channel when the router shares that node too (a datagram with the locator, the answer back the same
   way; wake_channel.py), else by a Ray call with the locator as plain values. Any
   other decode rank, or one that cannot map it, gets an object the source makes of
   the bytes (``ObjectFor``) as an argument of ``import_prefilled``: Ray
   resolves it (node-to-node transfer across nodes; a read-only view of the shared
   store on one node). The router only ever holds the locator, never the bytes. A
   streamed prompt's hand-off may skip the router's ask: its prefill rank, told the
   stream's decode rank (``DirectHandoff``, router/kv_stream.py), wakes that rank with
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

from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD,
    TRANSPORT,
    UNREACHABLE,
    DeliveryResult,
    DirectHandoff,
    KVTransport,
)
from pdserve.kv_transfer.base import node_id as this_node
from pdserve.kv_transfer.ray.calls import HandOffTo, ImportShared, ObjectFor, WithoutPrefix
from pdserve.kv_transfer.ray.shared_memory import SharedPayload
from pdserve.kv_transfer.ray.wake_channel import LocalImports, LocalReply

log = logging.getLogger(__name__)

# UNREACHABLE (base.FailureKind): what import_shared answers when it cannot map the
# sender's segment: use the object path
COPIES = {"shared memory (one node)": 2, "object store, one node": 3,
          "object store, across nodes": 4}


class RayObjectStoreTransport(KVTransport, DirectHandoff):
    """Deliver through shared memory or the object store (see the module docstring); a
    streamed prompt's prefill rank may ask its decode rank (same node) to import the
    hand-off itself, before the router has the ticket (``DirectHandoff``)."""

    name = "ray"

    def __init__(self) -> None:
        super().__init__()
        self._local = LocalImports()  # asks decode ranks on this node (wake_channel.py)
        self._node = ""
        self.num_local_imports = 0  # deliveries asked through it, not by a Ray call
        self.num_direct_local = 0  # direct hand-offs answered through it

    def _on_this_node(self, node_id: str) -> bool:
        if not self._node:  # "" until Ray is up in this process
            self._node = this_node()
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

    async def direct_answer(self, direct: Any, dst: Any, nbytes: int) -> DeliveryResult:
        """A direct hand-off's answer as ``deliver`` would report it: through the local
        channel (the ticket's ``LocalReply``), or the ObjectRef of the decode rank's
        answer to the prefill rank's Ray call. The caller bounds the wait."""
        if isinstance(direct, LocalReply):
            self.num_direct_local += 1
            result = await self._local.answer(direct.id,
                                              lambda: getattr(dst, "state", "") != "dead")
            return self._as_delivery(result, nbytes, 0)
        try:
            result = await direct
        except Exception as exc:  # the decode rank died, or the prefill rank that owns it
            return DeliveryResult(False, kind=TRANSPORT, error=f"{type(exc).__name__}: {exc}")
        return self._as_delivery(result, nbytes, 0)

    def tell_direct(self, src: Any, attempt: str, dst: Any, reply: str = "",
                    reply_id: str = "") -> Any:
        """Tell ``src`` that ``attempt``'s hand-off goes directly to ``dst`` (None: it does
        not); the call's ObjectRef."""
        wake = getattr(dst.info, "wake_address", "") if dst is not None and dst.info else ""
        return src.actor.kv_call.remote(HandOffTo(
            attempt, dst.actor if dst is not None else None, wake, reply, reply_id))

    def forget_direct(self, reply_id: str) -> None:
        """An expected answer nobody will wait for (the direct hand-off was called off)."""
        if reply_id:
            self._local.forget(reply_id)

    async def close(self) -> None:
        self._local.close()

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
                        result = await dst.actor.kv_call.remote(
                            ImportShared(locator.as_tuple(), skip_blocks))
                    if not result.ok and result.kind == UNREACHABLE:
                        result = None
                if result is None:  # another node, or it could not map the segment
                    obj = src.actor.kv_call.remote(ObjectFor(ticket.key, skip_blocks))
                    result = await dst.actor.import_prefilled.remote(obj)
            else:
                if skip_blocks:  # cut on the source, into a new object: the prefix stays there
                    locator = src.actor.kv_call.remote(WithoutPrefix(skip_blocks),
                                                       ticket.locator)
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
        return ticket.key if isinstance(ticket.locator, SharedPayload) else None
