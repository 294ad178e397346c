"""The ``grpc`` KV backend's wire: chunk framing, authorization metadata, limits.

Shared by both sides (endpoint.py: the rank's, transport.py: the router's); the whole
path, step by step, is told in this package's ``__init__``.
"""

from __future__ import annotations

import time

import grpc

from pdserve.kv_transfer.base import KVSecret
from pdserve.rpc import kv_transfer_pb2

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
        yield kv_transfer_pb2.KVChunk(attempt=attempt, data=b"")
        return
    for start in range(0, len(view), size):
        yield kv_transfer_pb2.KVChunk(attempt=attempt if start == 0 else "",
                                      data=bytes(view[start:start + size]))


# -- KVChunk on the wire -----------------------------------------------------------------
# The bulk path skips the protobuf runtime: building a KVChunk, serializing it, parsing it
# and reading its ``data`` each copy the chunk again (and churn fresh 1 MiB buffers), which
# measured as the largest Python-side cost of a hand-off (a bare Push server: ~1.4 ms of
# CPU per MiB parsing KVChunk messages, ~0.8 reading them serialized; a decode rank: ~0.15
# -> ~0.11 CPU-s per 64 MiB push, join included). A KVChunk is two length-delimited
# fields (kv_transfer.proto: 1 ``attempt``, 2 ``data``), so these encode and decode
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
    """One serialized ``KVChunk`` (``attempt`` only when ``attempt``, ``data`` only when
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
    """(``attempt``, ``data``) of one serialized ``KVChunk``, read as the protobuf runtime
    reads it (a field seen twice: the last wins; unknown fields are skipped), except that
    ``attempt`` or ``data`` in another wire type is refused, not kept as unknown; ``data``
    is a view of ``raw``, no copy. ``ValueError`` if ``raw`` is no well-formed ``KVChunk``."""
    view = memoryview(raw)
    end = len(view)
    pos = 0
    attempt, data = "", view[:0]
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
                attempt = str(value, "utf-8")  # UnicodeDecodeError is a ValueError
            elif field == 2:
                data = value
            continue
        if field in (1, 2):
            raise ValueError(f"field {field} has wire type {wire_type}")
        pos = _skip_field(view, pos, wire_type)
    return attempt, data


def _skip_field(view: memoryview, pos: int, wire_type: int) -> int:
    """Past an unknown field of ``wire_type`` (not length-delimited) starting at ``pos``."""
    if wire_type == 0:
        return _read_varint(view, pos)[1]
    if wire_type in (1, 5):
        pos += 8 if wire_type == 1 else 4
        if pos > len(view):
            raise ValueError("a fixed-width field runs past the end of the chunk")
        return pos
    raise ValueError(f"wire type {wire_type} is not allowed")


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
    # The payload format's own parser and bounds (engine/kv/payload.py).
    # lazy: engine.kv.payload imports torch; the router process (which relays) never needs it
    from pdserve.engine.kv.payload import _PREFIX, MAGIC, MAX_HEADER_BYTES, VERSION, _unpack_header

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
    attempt, tensor_bytes = header.get("attempt"), header.get("tensor_bytes")
    if not isinstance(attempt, str):
        raise PayloadRefused(bad, "KV payload header field 'attempt' is missing")
    if not isinstance(tensor_bytes, int) or isinstance(tensor_bytes, bool) or tensor_bytes < 0:
        raise PayloadRefused(bad, "KV payload header field 'tensor_bytes' must be an int >= 0")
    return attempt, body + tensor_bytes


