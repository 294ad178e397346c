"""The ``grpc`` KV backend: bytes through the router over gRPC, authenticated.

``wire.py``: chunks and authorization, ``endpoint.py``: the rank's side,
``transport.py``: the router's.

A hand-off, step by step (the copies each step makes are named; gRPC's own
serialize/parse happen once on each side of every hop):

1. Export (prefill rank): the payload (the engine's one ``bytes`` object: header plus
   tensors, built by ``KVPayload.to_bytes``) stays in the rank's ``GrpcEndpoint``; the
   locator is ``(address, attempt)``. No copy.
2. Authorize (router): for the hop it is about to make, the router computes
   ``HMAC-SHA256(secret, "pdserve-kv-auth/1" | op | attempt | address | expires)``
   (each field length-prefixed; see ``KVSecret``) with ``op`` ``fetch`` or ``push``,
   ``attempt`` the attempt key, ``address`` the *target* rank's KV address as that rank
   advertises it, and ``expires`` a unix time ``AUTH_VALIDITY_S`` ahead. It travels in
   gRPC metadata (``pdserve-kv-auth``, ``pdserve-kv-expires``, and for a push the
   attempt itself, ``pdserve-kv-attempt``). So an authorization is good for one
   operation on one attempt at one rank for a short while, and only the router (which
   alone holds the secret with the ranks) can make one: no extra round trip announces
   an attempt to a rank, the MAC is the announcement.
3. Fetch (prefill rank): the endpoint checks the MAC (``hmac.compare_digest``) and its
   expiry before it looks the payload up; missing, wrong, expired, for another
   operation, attempt or rank: ``UNAUTHENTICATED``, nothing else is touched. It then
   streams ``CHUNK_BYTES`` (1 MiB) chunks, each serialized by ``encoded_chunks`` (one
   copy per chunk: the slice joined behind its ``KVChunk`` field header; no protobuf
   message is built). Fetch does not consume the payload, so a relay that fails
   half-way can be retried on another decode rank.
4. Relay (router): each fetched chunk is pushed on as it arrives, still serialized: it is
   neither parsed nor re-serialized (no copy in Python; ``decode_chunk`` only reads its
   length to count the bytes moved), and the router never holds the whole payload.
5. Push (decode rank): before reading any chunk the endpoint checks the MAC for
   (``push``, the announced attempt, its own address); then it refuses a second push of
   an attempt it already took (a replay: ``ALREADY_EXISTS``; the router never pushes one
   attempt to one rank twice). As chunks arrive it parses the payload header as soon as
   it is complete: a header that is not a KV payload's, or names another attempt than
   the authorized one (a forged payload), is ``INVALID_ARGUMENT``; a payload larger
   than the rank's limit (by the size its header promises, or by the bytes sent) is
   ``RESOURCE_EXHAUSTED`` naming the limit. Each chunk is read in place
   (``decode_chunk``: a view of the received message; a malformed one is
   ``INVALID_ARGUMENT``) and appended to one growing ``bytearray`` as it arrives (one
   copy, overlapped with the stream; no second join at the end). Only the whole buffer
   is handed to ``importer.import_prefilled`` on a worker thread, which checks the
   payload whole and queues it (copies into tensors, then into KV blocks).
   A refused push never reaches the importer: no blocks are taken, nothing is queued.
6. Release / discard: the router releases the payload (``release_kv`` on the prefill
   rank, through Ray) only after the decode rank confirmed the import, within the
   base's release deadline (``RELEASE_TIMEOUT_S``; past it: logged and counted).

Limits: a Fetch or Push stream is aborted (``DEADLINE_EXCEEDED``) when it runs longer
than ``stream_timeout_s`` in all, or when a Push's next chunk (a Fetch's next write)
does not go through within ``chunk_timeout_s``. The endpoint is a ``grpc.aio`` server on
an event loop of its own thread: a stream in progress holds a coroutine, not a thread,
so idle or slow streams cannot keep a hand-off from being served; imports run on a
small thread pool of their own, only once a payload arrived whole. At most
``MAX_CONCURRENT_RPCS`` calls run at once (more: ``RESOURCE_EXHAUSTED``, which the
router treats as "try another decode rank").

Chunks cross the gRPC boundary serialized (``add_servicer``, ``GrpcBytesTransport._fetch``
/ ``_push``), in the wire format of ``kv_transfer.proto``'s ``KVChunk``, so any client
with the generated stubs still speaks to an endpoint. ``pdserve bench kv-transfer``
reports the hand-off beside ``grpc_ceiling``, a bare gRPC stream of the same chunks with
the same options on this machine: what gRPC alone can move, one hop, no checks.

The router maps a failed push to ``DeliveryResult`` kinds: ``RESOURCE_EXHAUSTED`` ->
capacity (try another decode rank), ``INVALID_ARGUMENT`` -> payload (never retried),
anything else -> transport. The MAC authenticates; it does not encrypt: the bytes (and
the prompt's token ids in the header) cross the network in the clear.
"""
