"""The ``device`` KV backend: device to device, by CUDA IPC on one node, else over a
torch.distributed pair group (NCCL send/recv). ``endpoint.py``: the ranks' side,
``transport.py``: the router's, ``calls.py``: what the router asks of a rank,
``cuda_ipc.py``: sharing and mapping device memory through the CUDA driver.

Transport ``device``: for ranks that hold GPUs, the payload never leaves GPU memory on
its way. Two CUDA ranks on one node (``maps``) hand off by CUDA IPC:

0. Map (router, then each side): the source answers ``SharePayload`` with the
   payload's ``IpcHandle`` (a cut prefix first copied on the device and kept with the
   payload until it is released), the destination answers ``MapPayload``: it checks the
   handle (this node, within the ticket's size), maps it, imports from it (the payload's
   tensors views of the sender's memory, scattered into its blocks: one device copy)
   and unmaps it before answering. The source holds the payload until the router
   releases or discards it, under the same rules as every backend (4 below); a
   destination that dies mid-import loses its mapping with its process. What the
   driver refuses (``UNREACHABLE``) sends that pair through steps 2-3 from then on,
   logged once; ``delivery_paths`` counts each path (``pdserve_kv_deliveries_total``).

Otherwise each (prefill rank, decode rank) pair gets a process group of its own, two
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
   only (``OpenPair``, ``dp_comm.listen_store``), then both ranks join
   concurrently (``JoinPair``) under the prefix ``pdserve/kv/<pair>/<nonce>``, with a
   fresh random nonce per group that is never logged (errors show ``<nonce>``). Every
   wait is bounded: the store and the group by ``form_timeout_s``, the router's calls by
   the same plus a margin, and a join that fails (a rank that died, say) ends the
   formation at once rather than after its peer's join gave up waiting. gloo needs the store only while the group forms: the source
   destroys the server at the pair's first send (both ranks joined by then); NCCL keeps
   it for the group's life (its communicator is made at the first send, through it).
3. Deliver (router): one transfer at a time per pair (so both sides issue their
   send/recv in the same order); the router asks the destination's ``ReceivePayload`` and
   the source's ``SendPayload`` concurrently. The source first sends the payload's size
   (one int64; 0 when it no longer holds the payload, so the receiver never waits for
   bytes that will not come), then the payload; the receiver checks the size against
   the ticket, receives into a tensor on its device and imports from it
   (the rank's ``import_prefilled``: the payload's tensors are views of the received
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
- cuda ipc (one node): gather into the lent device tensor (1), scatter from the mapped
  memory into the receiver's blocks (1): 2. A cut prefix adds one device copy.
- nccl (GPU to GPU): gather into the lent device tensor (1), wire (1), scatter into the
  receiver's blocks (1): 3, none of them through host memory. A cut prefix adds one
  device copy of the rest on the source.
- gloo, CPU ranks: gather (1), wire (1), scatter (1): 3.
- gloo, CUDA ranks on one GPU (or one CUDA, one CPU rank): gather (1), device to host
  (1), wire (1), host to device (1), scatter (1): 5.
A pair group left behind by a rank that died or left stays on its peer until the peer
drops the oldest (at most ``MAX_PAIRS`` per rank) or shuts down.
"""
