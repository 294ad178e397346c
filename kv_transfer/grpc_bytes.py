"""KV as bytes through the router over gRPC, all sides, authenticated.

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

from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent import futures
from typing import Any

import grpc

from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD,
    PAYLOAD_MAX_AGE_S,
    TRANSPORT,
    DeliveryResult,
    KVSecret,
    KVTransport,
    RankEndpoint,
    payload_without_prefix,
)
from pdserve.rpc import kv_transfer_pb2, kv_transfer_pb2_grpc

# Chunk size and HTTP/2 flow control, measured on a shared 2-core box over loopback
# (64 MiB relays, prefill rank -> router -> decode rank in three processes; medians of
# noisy runs): 2 and 4 MiB chunks were no faster than 1 MiB and 8 MiB ones ~40% slower
# (each hop holds a whole message before passing it on), so chunks stay 1 MiB. With BDP
# probing off, a stream's window stays at ``lookahead_bytes`` (64 KiB by default); a
# 16 MiB window and write buffer, and 16 MiB HTTP/2 frames (one DATA frame per chunk, not
# 64), took the relay from a median ~395 to ~440 MiB/s with less spread; BDP probing on
# instead was no better and as noisy. All of it stays within MAX_MESSAGE_BYTES.
CHUNK_BYTES = 1 << 20
# Copies of the KV bytes in pdserve's own code (gRPC core adds its own socket buffers):
# the engine's gather into the payload (1), Fetch's serialized chunks (1), the Push
# side's append (1), the import's scatter into blocks (1); the router relays as is.
COPIES = {"prefill -> router -> decode": 4}
MAX_MESSAGE_BYTES = 16 << 20
FLOW_WINDOW_BYTES = 16 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", FLOW_WINDOW_BYTES),
    ("grpc.http2.write_buffer_size", FLOW_WINDOW_BYTES),
    ("grpc.http2.max_frame_size", FLOW_WINDOW_BYTES - 1),  # HTTP/2's largest: 2**24 - 1
]

SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
FETCH, PUSH = "fetch", "push"
AUTH_KEY, EXPIRES_KEY, ATTEMPT_KEY = "pdserve-kv-auth", "pdserve-kv-expires", "pdserve-kv-attempt"
# An authorization is issued right before its call and only checked when the call
# starts, so it needs to live only that long; the skew allows for clocks of different
# nodes. A rank remembers pushed attempts for as long as their authorization is good.
AUTH_VALIDITY_S = 60
MAX_CLOCK_SKEW_S = 60
# Per-stream bounds (the router's own bound, handoff_timeout_s, is 60 s by default).
STREAM_TIMEOUT_S = 120.0
CHUNK_TIMEOUT_S = 10.0
MAX_CONCURRENT_RPCS = 256
# A rank whose importer does not say how much KV it can hold (test doubles, benches)
# takes pushed payloads up to this size.
DEFAULT_MAX_PUSH_BYTES = 1 << 30
# The header beside the tensors: at most 9 bytes per token id (8 since payload version 4,
# which carries them as int64s; msgpack's own ints took up to 9), plus this for the rest
# (ids, sampling, tensor specs: a few hundred bytes in practice).
HEADER_SLACK_BYTES = 1 << 20


def max_payload_bytes(max_tokens: int, tensor_bytes: int) -> int:
    """An upper bound on the size of a payload of at most ``max_tokens`` prompt tokens
    whose tensors hold at most ``tensor_bytes`` bytes (a rank's push limit)."""
    return HEADER_SLACK_BYTES + 9 * (max_tokens + 1) + tensor_bytes


def chunks(attempt: str, data: bytes, size: int = CHUNK_BYTES):
    """``data`` as ``KVChunk`` messages (the first names ``attempt``), for a client with
    the generated stub; the endpoint itself sends ``encoded_chunks``."""
    view = memoryview(data)
    if not view:
        yield kv_transfer_pb2.KVChunk(request_id=attempt, data=b"")
        return
    for start in range(0, len(view), size):
        yield kv_transfer_pb2.KVChunk(request_id=attempt if start == 0 else "",
                                      data=bytes(view[start:start + size]))


# -- KVChunk on the wire -----------------------------------------------------------------
# The bulk path skips the protobuf runtime: building a KVChunk, serializing it, parsing it
# and reading its ``data`` each copy the chunk again (and churn fresh 1 MiB buffers), which
# measured as the largest Python-side cost of a hand-off (a bare Push server: ~1.4 ms of
# CPU per MiB parsing KVChunk messages, ~0.8 reading them serialized; a decode rank: ~0.15
# -> ~0.11 CPU-s per 64 MiB push, join included). A KVChunk is two length-delimited
# fields (kv_transfer.proto: 1 ``request_id``, 2 ``data``), so these encode and decode
# exactly those bytes; the wire format (and the .proto) stays what the generated stubs speak.

_REQUEST_ID_TAG, _DATA_TAG = b"\x0a", b"\x12"  # (field << 3) | 2: length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def encode_chunk(attempt: str, piece) -> bytes:
    """One serialized ``KVChunk`` (``request_id`` only when ``attempt``, ``data`` only when
    ``piece``, as proto3 writes them); one copy of ``piece``."""
    parts = []
    if attempt:
        raw = attempt.encode("utf-8")
        parts += (_REQUEST_ID_TAG, _varint(len(raw)), raw)
    if len(piece):
        parts += (_DATA_TAG, _varint(len(piece)), piece)
    return b"".join(parts)


def encoded_chunks(attempt: str, data: bytes, size: int = CHUNK_BYTES):
    """``data`` as serialized ``KVChunk`` messages of ``size`` bytes; the first names
    ``attempt``. One copy per chunk (memoryview slices joined behind their field header)."""
    view = memoryview(data)
    if not view:
        yield encode_chunk(attempt, b"")
        return
    for start in range(0, len(view), size):
        yield encode_chunk(attempt if start == 0 else "", view[start:start + size])


def decode_chunk(raw: bytes) -> tuple[str, memoryview]:
    """(``request_id``, ``data``) of one serialized ``KVChunk``, read as the protobuf runtime
    reads it (a field seen twice: the last wins; unknown fields are skipped), except that
    ``request_id`` or ``data`` in another wire type is refused, not kept as unknown; ``data``
    is a view of ``raw``, no copy. ``ValueError`` if ``raw`` is no well-formed ``KVChunk``."""
    view = memoryview(raw)
    end = len(view)
    pos = 0
    request_id, data = "", view[:0]
    while pos < end:
        key, pos = _read_varint(view, pos)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire_type == 2:
            n, pos = _read_varint(view, pos)
            if n > end - pos:
                raise ValueError("a field runs past the end of the chunk")
            value = view[pos:pos + n]
            pos += n
            if field == 1:
                request_id = str(value, "utf-8")  # UnicodeDecodeError is a ValueError
            elif field == 2:
                data = value
            continue
        if field in (1, 2):
            raise ValueError(f"field {field} has wire type {wire_type}")
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            if pos > end:
                raise ValueError("a fixed-width field runs past the end of the chunk")
        else:
            raise ValueError(f"wire type {wire_type} is not allowed")
    return request_id, data


def auth_metadata(secret: KVSecret, operation: str, attempt: str, address: str,
                  validity_s: float = AUTH_VALIDITY_S) -> tuple[tuple[str, str], ...]:
    """The metadata that authorizes ``operation`` on ``attempt`` at the rank ``address``."""
    expires = int(time.time() + validity_s)
    return ((AUTH_KEY, secret.authorize(operation, attempt, address, expires)),
            (EXPIRES_KEY, str(expires)), (ATTEMPT_KEY, attempt))


class PayloadRefused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def peek_header(head: bytes | bytearray) -> tuple[str, int] | None:
    """(attempt the payload names, its whole size) once ``head`` holds the payload's
    whole header; None while it does not yet. ``PayloadRefused`` if it is no KV payload."""
    # The payload format's own parser and bounds (engine/kv_payload.py); imported here,
    # not at module import: the router process never needs torch.
    from pdserve.engine.kv_payload import _PREFIX, MAGIC, MAX_HEADER_BYTES, VERSION, _unpack_header

    if len(head) < _PREFIX.size:
        return None
    magic, version, header_len = _PREFIX.unpack(bytes(head[:_PREFIX.size]))
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if magic != MAGIC:
        raise PayloadRefused(bad, "not a KV payload: bad magic bytes")
    if version != VERSION:
        raise PayloadRefused(bad, f"KV payload version {version} is not supported")
    if header_len > MAX_HEADER_BYTES:
        raise PayloadRefused(bad, f"KV payload header length {header_len} exceeds "
                                  f"{MAX_HEADER_BYTES} bytes")
    body = _PREFIX.size + header_len
    if len(head) < body:
        return None
    try:
        header = _unpack_header(memoryview(head)[_PREFIX.size:body])
    except ValueError as exc:
        raise PayloadRefused(bad, str(exc)) from None
    attempt, tensor_bytes = header.get("request_id"), header.get("tensor_bytes")
    if not isinstance(attempt, str):
        raise PayloadRefused(bad, "KV payload header field 'request_id' is missing")
    if not isinstance(tensor_bytes, int) or isinstance(tensor_bytes, bool) or tensor_bytes < 0:
        raise PayloadRefused(bad, "KV payload header field 'tensor_bytes' must be an int >= 0")
    return attempt, body + tensor_bytes


# -- rank side --------------------------------------------------------------------------

class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """``Fetch`` serves the endpoint's payloads; ``Push`` imports into its importer (an
    object with ``import_prefilled(bytes) -> ImportResult``). Both authenticate first."""

    def __init__(self, endpoint: GrpcEndpoint) -> None:
        self.endpoint = endpoint

    async def Fetch(self, request, context):
        ep = self.endpoint
        attempt = request.request_id
        await ep.authenticate(context, FETCH, attempt)
        data = ep.get(attempt)
        if data is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no KV payload for attempt {attempt!r} on this rank")
        if request.skip_blocks:  # the receiver's cache holds that prefix: it stays here
            data = await asyncio.get_running_loop().run_in_executor(
                None, payload_without_prefix, data, request.skip_blocks)
        deadline = asyncio.get_running_loop().time() + ep.stream_timeout_s
        for chunk in encoded_chunks(attempt, data):
            await ep.bounded(context, lambda chunk=chunk: context.write(chunk), deadline, "fetch",
                             "the next chunk was not taken")

    async def Push(self, request_iterator, context):
        ep = self.endpoint
        attempt = _metadata(context).get(ATTEMPT_KEY, "")
        await ep.authenticate(context, PUSH, attempt)
        if not ep.claim(attempt):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"attempt {attempt!r} was already pushed to this rank: "
                                "a replayed push is refused")
        data = await self._receive(context, attempt)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(ep.imports, ep.importer.import_prefilled, data)
        if not result.ok:
            code = {CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
                    CACHE_MISS: grpc.StatusCode.FAILED_PRECONDITION}.get(
                        result.kind, grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, result.error)
        return kv_transfer_pb2.PushResponse(request_id=result.attempt)

    async def _receive(self, context, attempt: str) -> bytearray:
        """The pushed payload whole, checked against the authorization and the limit; each
        chunk is read in place (``decode_chunk``) and copied once, onto the end of it."""
        ep = self.endpoint
        limit = ep.max_push_bytes
        over = (f"the pushed KV payload exceeds this rank's limit of {limit} bytes "
                f"(max_push_bytes: the largest sequence its KV blocks can hold, plus header)")
        deadline = asyncio.get_running_loop().time() + ep.stream_timeout_s
        payload = bytearray()  # grows by realloc (mremap for large sizes), no re-copy
        size = 0
        head: bytearray | None = bytearray()  # until the header is complete
        expected = None
        try:
            while True:
                msg = await ep.bounded(context, context.read, deadline, "push",
                                       "no chunk arrived")
                if msg is grpc.aio.EOF:
                    break
                try:
                    named, data = decode_chunk(msg)
                except ValueError as exc:
                    raise PayloadRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                         f"malformed KV chunk: {exc}") from None
                if named and named != attempt:
                    raise PayloadRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                         f"chunk names attempt {named!r}, the push "
                                         f"is authorized for {attempt!r}")
                size += len(data)
                if size > limit:
                    raise PayloadRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, over)
                payload += data
                if head is not None:
                    head += data
                    found = peek_header(head)
                    if found is not None:
                        named, expected = found
                        head = None
                        if named != attempt:
                            raise PayloadRefused(
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"the payload's header names attempt {named!r}, the push is "
                                f"authorized for {attempt!r}: refused")
                        if expected > limit:
                            raise PayloadRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                 f"{over}; its header promises {expected}")
                if expected is not None and size > expected:
                    raise PayloadRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                         f"more KV payload bytes than its header promises "
                                         f"({expected})")
            if expected is None:
                raise PayloadRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"KV payload truncated: {size} bytes, no whole header")
            if size != expected:
                raise PayloadRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"KV payload truncated: {size} bytes, header promises "
                                     f"{expected}")
        except PayloadRefused as refused:
            await context.abort(refused.code, refused.details)
        return payload


def add_servicer(servicer: KVTransferServicer, server) -> None:
    """Serve ``servicer`` on ``server`` as the generated ``add_KVTransferServicer_to_server``
    does, except that chunks cross the gRPC boundary serialized (``encoded_chunks`` out of
    ``Fetch``, ``decode_chunk`` inside ``Push``) instead of as protobuf messages."""
    handlers = {
        "Fetch": grpc.unary_stream_rpc_method_handler(
            servicer.Fetch, request_deserializer=kv_transfer_pb2.FetchRequest.FromString,
            response_serializer=None),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=None,
            response_serializer=kv_transfer_pb2.PushResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _metadata(context) -> dict[str, str]:
    return {m.key: m.value for m in context.invocation_metadata() or ()
            if isinstance(m.value, str)}


class GrpcEndpoint(RankEndpoint):
    """Keeps exported payloads and serves them (and imports) on a port of its own: a
    ``grpc.aio`` server on an event loop in a background thread.

    ``secret``: the cluster's ``KVSecret`` (without one, every call is refused).
    ``max_push_bytes``: the largest payload a push may carry. ``stream_timeout_s`` and
    ``chunk_timeout_s`` bound every stream (see the module docstring)."""

    def __init__(self, importer: Any, host: str, secret: KVSecret | None = None, *,
                 max_age_s: float = PAYLOAD_MAX_AGE_S, max_push_bytes: int | None = None,
                 stream_timeout_s: float = STREAM_TIMEOUT_S,
                 chunk_timeout_s: float = CHUNK_TIMEOUT_S,
                 max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
                 import_threads: int = 2) -> None:
        super().__init__(max_age_s)
        self.importer = importer
        self._secret = secret
        self.max_push_bytes = int(max_push_bytes or DEFAULT_MAX_PUSH_BYTES)
        self.stream_timeout_s = float(stream_timeout_s)
        self.chunk_timeout_s = float(chunk_timeout_s)
        self._pushed: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._pushed_lock = threading.Lock()
        self.imports = futures.ThreadPoolExecutor(max_workers=import_threads,
                                                  thread_name_prefix="kv-import")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-grpc",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        bind = f"[{host}]" if ":" in host else host
        try:
            self.server, port = asyncio.run_coroutine_threadsafe(
                self._start(bind, max_concurrent_rpcs), self._loop).result(30)
        except BaseException:
            self._stop_loop()
            raise
        self.address = f"{bind}:{port}"

    async def _start(self, bind: str, max_concurrent_rpcs: int):
        server = grpc.aio.server(options=CHANNEL_OPTIONS,
                                 maximum_concurrent_rpcs=max_concurrent_rpcs)
        add_servicer(KVTransferServicer(self), server)
        port = server.add_insecure_port(f"{bind}:0")
        await server.start()
        return server, port

    # -- checks (on the server's loop) ---------------------------------------------------

    def check_authorization(self, metadata: dict[str, str], operation: str,
                            attempt: str) -> str | None:
        """None if ``metadata`` authorizes ``operation`` on ``attempt`` at this rank, else
        why not."""
        if self._secret is None:
            return "this rank holds no KV key: every transfer is refused"
        mac, expires = metadata.get(AUTH_KEY), metadata.get(EXPIRES_KEY)
        if not mac or not expires or not attempt:
            return "missing KV authorization"
        try:
            expires_at = int(expires)
        except ValueError:
            return "malformed KV authorization"
        now = time.time()
        if not now - MAX_CLOCK_SKEW_S <= expires_at <= now + AUTH_VALIDITY_S + MAX_CLOCK_SKEW_S:
            return "the KV authorization has expired (or its clock is far off)"
        if not self._secret.verify(operation, attempt, self.address, expires_at, mac):
            return "invalid KV authorization"
        return None

    async def authenticate(self, context, operation: str, attempt: str) -> None:
        why = self.check_authorization(_metadata(context), operation, attempt)
        if why is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    def claim(self, attempt: str) -> bool:
        """True once per attempt (for as long as an authorization for it can be valid)."""
        now = time.time()
        with self._pushed_lock:
            while self._pushed:
                first, until = next(iter(self._pushed.items()))
                if until >= now:
                    break
                del self._pushed[first]
            if attempt in self._pushed:
                return False
            self._pushed[attempt] = now + AUTH_VALIDITY_S + 2 * MAX_CLOCK_SKEW_S
            return True

    async def bounded(self, context, step, deadline: float, what: str, stalled: str):
        """``await step()`` within the chunk timeout and the stream's deadline, else abort."""
        remaining = deadline - asyncio.get_running_loop().time()
        timeout = min(self.chunk_timeout_s, remaining)
        if timeout > 0:
            try:
                return await asyncio.wait_for(step(), timeout)
            except asyncio.TimeoutError:
                pass
        if remaining <= self.chunk_timeout_s:
            why = f"the {what} stream ran longer than {self.stream_timeout_s:g}s"
        else:
            why = f"{stalled} within {self.chunk_timeout_s:g}s: the {what} stream is aborted"
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)

    # -- rank side ---------------------------------------------------------------------

    def export(self, attempt: str, payload: bytes) -> Any:
        super().export(attempt, payload)
        return (self.address, attempt)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(None), self._loop).result(10)
        except Exception:  # a loop that is gone already
            pass
        self._stop_loop()
        super().close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        self.imports.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return f"GrpcEndpoint({getattr(self, 'address', None)}, {len(self)} payloads, key hidden)"


# -- router side ------------------------------------------------------------------------

class GrpcBytesTransport(KVTransport):
    """Relays a payload from the prefill rank's ``Fetch`` to the decode rank's ``Push``,
    each call authorized with the cluster's ``secret`` (see the module docstring)."""

    name = "grpc"

    def __init__(self, secret: KVSecret | None, stream_timeout_s: float = STREAM_TIMEOUT_S) -> None:
        if not isinstance(secret, KVSecret):
            raise TypeError("the grpc KV transport needs the cluster's KVSecret "
                            "(make_transport('grpc', secret=...))")
        super().__init__()
        self._secret = secret
        self.stream_timeout_s = stream_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(
                address, options=CHANNEL_OPTIONS)
        return channel

    def _fetch(self, address: str):
        """``Fetch`` at ``address``, its chunks left serialized (relayed as they are)."""
        return self._channel(address).unary_stream(
            f"/{SERVICE}/Fetch", request_serializer=kv_transfer_pb2.FetchRequest.SerializeToString,
            response_deserializer=None)

    def _push(self, address: str):
        """``Push`` at ``address``, taking serialized chunks."""
        return self._channel(address).stream_unary(
            f"/{SERVICE}/Push", request_serializer=None,
            response_deserializer=kv_transfer_pb2.PushResponse.FromString)

    async def deliver(self, ticket: Any, src: Any, dst: Any,
                      skip_blocks: int = 0) -> DeliveryResult:
        dst_address = dst.info.kv_address
        if not dst_address:
            return DeliveryResult(False, kind=TRANSPORT,
                                  error="the decode rank serves no KV endpoint")
        src_address, attempt = ticket.locator
        moved = 0
        fetch_failed: list[Exception] = []

        async def relay():
            nonlocal moved
            fetch = self._fetch(src_address)(
                kv_transfer_pb2.FetchRequest(request_id=attempt, skip_blocks=skip_blocks),
                timeout=self.stream_timeout_s,
                metadata=auth_metadata(self._secret, FETCH, attempt, src_address))
            try:
                async for chunk in fetch:
                    moved += len(decode_chunk(chunk)[1])  # a view: the chunk is not copied
                    yield chunk
            except Exception as exc:  # gRPC then cancels the Push: say why
                fetch_failed.append(exc)
                raise

        try:
            reply = await self._push(dst_address)(
                relay(), timeout=self.stream_timeout_s,
                metadata=auth_metadata(self._secret, PUSH, attempt, dst_address))
        except grpc.aio.AioRpcError as exc:
            kind = {grpc.StatusCode.RESOURCE_EXHAUSTED: CAPACITY,
                    grpc.StatusCode.FAILED_PRECONDITION: CACHE_MISS,
                    grpc.StatusCode.INVALID_ARGUMENT: PAYLOAD}.get(exc.code(), TRANSPORT)
            return DeliveryResult(False, kind=kind, error=exc.details() or str(exc.code()))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the router cancelled the hand-off itself
            # a relay whose Fetch side failed or was cancelled surfaces as CancelledError here
            if fetch_failed:
                exc = fetch_failed[0]
                why = (exc.details() or str(exc.code()) if isinstance(exc, grpc.aio.AioRpcError)
                       else f"{type(exc).__name__}: {exc}")
                return DeliveryResult(False, kind=TRANSPORT, error=f"the KV fetch failed: {why}")
            return DeliveryResult(False, kind=TRANSPORT, error="the KV relay was cancelled")
        except Exception as exc:  # a failed relay surfaces here too (never escapes)
            return DeliveryResult(False, kind=TRANSPORT, error=f"{type(exc).__name__}: {exc}")
        self._delivered(moved)
        return DeliveryResult(True, attempt=reply.request_id, nbytes=moved)

    def held_key(self, ticket: Any) -> str | None:
        return ticket.locator[1]  # (address, attempt); freed through the base's path

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def __repr__(self) -> str:
        return f"GrpcBytesTransport({len(getattr(self, '_channels', {}))} channels, key hidden)"
