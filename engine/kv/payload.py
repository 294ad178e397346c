"""The KV hand-off payload: a versioned msgpack header followed by raw tensor bytes.

Layout of one payload (all integers little-endian):

    b"PDKV" | u16 version | u32 header length | msgpack header | tensor bytes

The header names every tensor with its dtype, shape, offset and length inside the
tensor section, so a receiver can check a payload completely before it allocates
anything, and a truncated payload is caught by arithmetic rather than by a crash. The
header is padded (its ``pad`` field) so that the tensor section starts 64-byte aligned.
Its ``token_ids`` are one msgpack ``bin`` of little-endian int64s (8 bytes an id), not
a list of ints: the receiver sizes them by their byte length and checks them with
numpy, not id by id.

No copies of its own: a sender lays the payload out first (``KVPayload.layout``) and
gathers its KV blocks straight into the tensor section of whatever buffer its transport
hands over (``PayloadLayout.write``); a receiver's tensors are views of the bytes it was
given (``from_bytes``), which the engine scatters straight into its blocks. The tensor
section itself (its entries, layout and views) is engine/kv/payload_tensors.py.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from pdserve.engine.kv.payload_tensors import (
    DeviceBytes,
    KVPayloadError,
    PayloadLayout,
    TensorSpec,
    check_tensor_specs,
    dtype_name,
    is_int,
    tensor_views,
)
from pdserve.scheduler.sampling_params import MAX_CHOICES

MAGIC = b"PDKV"
# 2: forks (n > 1); 3: kind and stream_of (streamed chunks); 4: token_ids as int64 bytes
VERSION = 4
KINDS = ("prefilled", "chunk")
_PREFIX = struct.Struct("<4sHI")

# Bounds that keep a corrupt or hostile payload from making the receiver allocate much
# before it is refused; real payloads stay far below them.
MAX_HEADER_BYTES = 64 << 20
MAX_TOKEN_IDS = 1 << 22  # token_ids: prompt plus first token
_TOKEN_ID = np.dtype("<i8")  # token_ids' element on the wire
_MAX_MAP_LEN = 1024  # the header and its sampling dict hold a dozen keys each
# The longest lists a header holds: tensors (MAX_TENSORS), forks (MAX_FORKS) and a
# sampling dict's stop_token_ids (the router takes at most 64); token_ids are bytes.
_MAX_ARRAY_LEN = 1 << 16
ALIGN = 64  # the tensor section's start, in bytes from the payload's first byte


def _unpack_header(raw: memoryview) -> dict:
    try:
        # msgpack sizes a list, dict or bin by the length its header claims; capping those
        # (each element takes at least a byte, so never above the buffer) bounds what it
        # allocates. A bin (token_ids) is capped by the buffer alone, so that an
        # over-long one is named by the field's own check.
        header = msgpack.unpackb(raw, raw=False,
                                 max_array_len=min(_MAX_ARRAY_LEN, len(raw)),
                                 max_map_len=min(_MAX_MAP_LEN, len(raw) // 2),
                                 max_bin_len=len(raw))
    except Exception as exc:  # msgpack raises several types for garbage
        raise KVPayloadError(f"KV payload header is not valid msgpack: {exc}") from exc
    if not isinstance(header, dict):
        raise KVPayloadError(f"KV payload header must be a map, got {type(header).__name__}")
    return header


class _HeaderFields:
    """Typed access to the header's fields; each failure names the field."""

    def __init__(self, header: dict) -> None:
        self._header = header

    def get(self, name: str) -> Any:
        if name not in self._header:
            raise KVPayloadError(f"KV payload header field {name!r} is missing")
        return self._header[name]

    def of_type(self, name: str, kind: type) -> Any:
        value = self.get(name)
        if not isinstance(value, kind):
            raise KVPayloadError(f"KV payload header field {name!r} must be a "
                                 f"{kind.__name__}, got {type(value).__name__}")
        return value

    def int_at_least(self, name: str, minimum: int) -> int:
        value = self.get(name)
        if not is_int(value) or value < minimum:
            raise KVPayloadError(f"KV payload header field {name!r} must be an int >= {minimum}, "
                                 f"got {value!r}")
        return value

    def finite_number(self, name: str) -> float:
        value = self.get(name)
        if not (isinstance(value, float) or is_int(value)) or not math.isfinite(value):
            raise KVPayloadError(f"KV payload header field {name!r} must be a finite number, "
                                 f"got {value!r}")
        return float(value)


def _pack_token_ids(token_ids: list[int]) -> bytes:
    """``token_ids`` as the header carries them: little-endian int64s (``struct``: about
    half of what ``array.array`` or msgpack's own list of ints takes for 4k ids)."""
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise KVPayloadError(f"KV payload token_ids cannot be carried as int64s: {exc}") from None


def _check_token_ids(raw: bytes, vocab_size: int | None) -> list[int]:
    """The ids of ``raw`` (little-endian int64s), each checked; sized by the byte length
    before anything is converted."""
    if len(raw) % _TOKEN_ID.itemsize:
        raise KVPayloadError(f"KV payload header field 'token_ids' must be little-endian int64s: "
                             f"{len(raw)} bytes is not a multiple of {_TOKEN_ID.itemsize}")
    count = len(raw) // _TOKEN_ID.itemsize
    if count > MAX_TOKEN_IDS:
        raise KVPayloadError(f"KV payload header field 'token_ids' holds {count} ids, "
                             f"more than {MAX_TOKEN_IDS}")
    ids = np.frombuffer(raw, dtype=_TOKEN_ID)  # a view, no copy
    # min and max in C over the common, valid case; the slow scan below only runs to
    # name the first bad id. (Every int64 is below 2**63: only 0 bounds them without
    # vocab_size.)
    if not count or (int(ids.min()) >= 0
                     and (vocab_size is None or int(ids.max()) < vocab_size)):
        return ids.tolist()
    upper = vocab_size if vocab_size is not None else 1 << 63
    within = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
    i, token = next((i, t) for i, t in enumerate(ids.tolist()) if not 0 <= t < upper)
    raise KVPayloadError(f"KV payload header field 'token_ids[{i}]' must be an int "
                         f"{within}, got {token!r}")


def _check_sampling(sampling: dict, where: str) -> dict:
    for key in sampling:
        if not isinstance(key, str):
            raise KVPayloadError(f"KV payload header field {where!r} has a non-string key {key!r}")
    return sampling


def _check_forks(entries: list, vocab_size: int | None, lead_id: str) -> list[ForkedChoice]:
    if len(entries) > MAX_FORKS:
        raise KVPayloadError(f"KV payload header field 'forks' holds {len(entries)} entries, "
                             f"more than {MAX_FORKS}")
    forks, seen = [], {lead_id}
    for i, entry in enumerate(entries):
        where = f"forks[{i}]"
        if not isinstance(entry, list) or len(entry) != 3:
            raise KVPayloadError(f"KV payload header field {where!r} must be "
                                 f"[attempt, first_token_id, sampling], got {entry!r:.200}")
        attempt, first_token_id, sampling = entry
        if not isinstance(attempt, str) or not attempt or attempt in seen:
            raise KVPayloadError(f"KV payload header field '{where}.attempt' must be a "
                                 f"new non-empty str, got {attempt!r:.100}")
        seen.add(attempt)
        upper = vocab_size if vocab_size is not None else 1 << 63
        if not is_int(first_token_id) or not 0 <= first_token_id < upper:
            raise KVPayloadError(f"KV payload header field '{where}.first_token_id' must be a "
                                 f"token id below {upper}, got {first_token_id!r:.100}")
        if not isinstance(sampling, dict):
            raise KVPayloadError(f"KV payload header field '{where}.sampling' must be a map, "
                                 f"got {type(sampling).__name__}")
        forks.append(ForkedChoice(attempt, first_token_id,
                                  _check_sampling(sampling, f"{where}.sampling")))
    return forks


MAX_FORKS = MAX_CHOICES - 1  # the lead's siblings


@dataclass
class ForkedChoice:
    """Another choice of the same prompt (n > 1): it forks from the imported prompt's
    KV with its own first token and settings (``sampling``: a dict until imported)."""

    attempt: str
    first_token_id: int
    sampling: Any


@dataclass
class KVPayload:
    """Everything a COMPLETION engine needs to continue a prefilled request."""

    attempt: str
    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    token_ids: list[int]  # the whole history: prompt plus the first sampled token
    num_prompt_tokens: int
    sampling: dict[str, Any]
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # name -> tensor; "k.{layer}"/"v.{layer}" hold [num_prompt_tokens, kv_heads, head_dim],
    # "ring_k.{layer}"/"ring_v.{layer}" the sliding-window ring of that layer.
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    forks: list[ForkedChoice] = field(default_factory=list)
    # Leading full blocks left out (prefix caching): the receiver holds them in its own
    # cache, named by the prompt's block hashes; the tensors start after them.
    skipped_blocks: int = 0
    # "prefilled": a whole prefilled request (less its skipped prefix). "chunk": the KV of
    # blocks ``skipped_blocks ..`` of a prompt still being prefilled, streamed ahead of its
    # "prefilled" payload; ``token_ids`` are then the tokens of its blocks (no first token).
    kind: str = "prefilled"
    # the attempt whose prompt streamed in chunks: a chunk's, and the "prefilled" payload
    # that follows them (its skipped prefix is what they carried); "" if none streamed
    stream_of: str = ""
    # receiver side: its cached blocks for the skipped prefix, referenced until import;
    # their hashes only when they are a partial import's (made as its chunks came),
    # which the prefix cache does not name yet
    cached_block_ids: list[int] = field(default_factory=list)
    cached_block_hashes: list[bytes] = field(default_factory=list)

    def without_prefix(self, num_blocks: int) -> KVPayload:
        """The same payload without its first ``num_blocks`` full blocks of KV, for a
        receiver whose prefix cache holds them (full-attention tensors only: a model
        with a sliding-window ring keeps no prefix cache)."""
        if num_blocks <= 0:
            return self
        if set(self.tensors) != {"k_blocks", "v_blocks"}:
            raise KVPayloadError("only a payload of full-attention blocks can leave out a "
                                 f"cached prefix (it holds {sorted(self.tensors)})")
        tensors = {name: t[:, num_blocks:] for name, t in self.tensors.items()}  # views
        return dataclasses.replace(self, tensors=tensors,
                                   skipped_blocks=self.skipped_blocks + num_blocks)

    def without_lead(self) -> KVPayload:
        """The same prompt's KV led by its first fork (the lead was aborted)."""
        lead, rest = self.forks[0], self.forks[1:]
        return dataclasses.replace(
            self, attempt=lead.attempt, sampling=lead.sampling, forks=rest,
            token_ids=[*self.token_ids[:self.num_prompt_tokens], lead.first_token_id])

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens

    @property
    def first_token_id(self) -> int:
        return self.token_ids[-1]

    def layout(self, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> PayloadLayout:
        """Where each tensor of ``shapes`` (name -> dtype, shape) goes in this payload's
        bytes, and the header that says so; ``self.tensors`` is not read."""
        specs, offset = [], 0
        for name, (dtype, shape) in shapes.items():
            nbytes = math.prod(shape) * dtype.itemsize
            specs.append(TensorSpec(name, dtype_name(dtype), tuple(shape), offset, nbytes))
            offset += nbytes
        header = {
            "attempt": self.attempt,
            "model_fingerprint": self.model_fingerprint,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_tokens": self.num_prompt_tokens,
            "token_ids": _pack_token_ids(self.token_ids),
            "sampling": self.sampling,
            "arrival_time": self.arrival_time,
            "first_token_time": self.first_token_time,
            "layout": "token-major [tokens, kv_heads, head_dim] per layer; ring [ring_len, kv_heads, head_dim]",
            "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in specs],
            "tensor_bytes": offset,
            "forks": [[f.attempt, f.first_token_id, f.sampling] for f in self.forks],
            "skipped_blocks": self.skipped_blocks,
            "kind": self.kind,
            "stream_of": self.stream_of,
            "pad": b"",
        }
        packed = msgpack.packb(header, use_bin_type=True)  # ends with pad's b"\xc4\x00"
        pad = -(_PREFIX.size + len(packed)) % ALIGN
        if pad:  # a bin of up to 255 bytes keeps its 2-byte marker: only the length grows
            packed = packed[:-1] + bytes([pad]) + bytes(pad)
        head = _PREFIX.pack(MAGIC, VERSION, len(packed)) + packed
        return PayloadLayout(head, specs)

    def to_bytes(self) -> bytes:
        return bytes(self.encode())

    def encode(self, buffer: Any = None) -> Any:
        """This payload written into ``buffer`` (a writable buffer of exactly
        ``layout(...).nbytes`` bytes; default a new bytearray), which is returned."""
        layout = self.layout({n: (t.dtype, tuple(t.shape)) for n, t in self.tensors.items()})
        if buffer is None:
            buffer = bytearray(layout.nbytes)
        for name, view in layout.write(buffer).items():
            view.copy_(self.tensors[name])
        return buffer

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *,
                   vocab_size: int | None = None) -> KVPayload:
        """Decode a payload, checking all of its header before copying any tensor bytes.

        With ``vocab_size``, every token id must lie in [0, vocab_size). Anything wrong
        raises KVPayloadError naming the field or tensor. ``data`` may also be a 1-D
        uint8 tensor (see ``from_tensor``).
        """
        data = DeviceBytes(data) if isinstance(data, torch.Tensor) else memoryview(data).cast("B")
        if len(data) < _PREFIX.size:
            raise KVPayloadError(f"KV payload truncated: {len(data)} bytes, no header")
        magic, version, header_len = _PREFIX.unpack(data[: _PREFIX.size])
        if magic != MAGIC:
            raise KVPayloadError("not a KV payload: bad magic bytes")
        if version != VERSION:
            raise KVPayloadError(f"KV payload version {version} is not supported (expected {VERSION})")
        if header_len > MAX_HEADER_BYTES:
            raise KVPayloadError(
                f"KV payload header length {header_len} exceeds {MAX_HEADER_BYTES} bytes")
        body = _PREFIX.size + header_len
        if len(data) < body:
            raise KVPayloadError(f"KV payload truncated inside its header ({len(data)} < {body} bytes)")
        header = _unpack_header(data[_PREFIX.size : body])
        fields = _HeaderFields(header)
        tensor_bytes = fields.int_at_least("tensor_bytes", 0)
        expected = body + tensor_bytes
        if len(data) != expected:
            raise KVPayloadError(
                f"KV payload truncated: {len(data)} bytes, header promises {expected}"
            )
        attempt = fields.of_type("attempt", str)
        model_fingerprint = fields.of_type("model_fingerprint", str)
        dtype = fields.of_type("dtype", str)
        fields.of_type("layout", str)  # informational, but part of the format
        block_size = fields.int_at_least("block_size", 1)
        num_layers = fields.int_at_least("num_layers", 1)
        num_tokens = fields.int_at_least("num_tokens", 0)
        token_ids = _check_token_ids(fields.of_type("token_ids", bytes), vocab_size)
        sampling = _check_sampling(fields.of_type("sampling", dict), "sampling")
        forks = _check_forks(fields.of_type("forks", list), vocab_size, attempt)
        skipped_blocks = fields.int_at_least("skipped_blocks", 0)
        kind = fields.of_type("kind", str)
        if kind not in KINDS:
            raise KVPayloadError(f"KV payload header field 'kind' must be one of {KINDS}, "
                                 f"got {kind!r:.50}")
        stream_of = fields.of_type("stream_of", str)
        if kind == "chunk" and (not stream_of or num_tokens % block_size or forks):
            raise KVPayloadError("KV payload of kind 'chunk' needs 'stream_of', whole blocks "
                                 f"('num_tokens' {num_tokens} is not a multiple of "
                                 f"{block_size}) and no forks")
        if skipped_blocks * block_size >= max(num_tokens, 1):
            raise KVPayloadError(f"KV payload header field 'skipped_blocks' is {skipped_blocks}: "
                                 f"more than the {num_tokens} prompt tokens' full blocks")
        arrival_time = fields.finite_number("arrival_time")
        first_token_time = (None if fields.get("first_token_time") is None
                            else fields.finite_number("first_token_time"))
        specs = check_tensor_specs(fields.of_type("tensors", list), tensor_bytes)

        tensors = tensor_views(data, body, specs)
        return cls(
            attempt=attempt,
            model_fingerprint=model_fingerprint,
            dtype=dtype,
            block_size=block_size,
            num_layers=num_layers,
            token_ids=token_ids,
            num_prompt_tokens=num_tokens,
            sampling=sampling,
            arrival_time=arrival_time,
            first_token_time=first_token_time,
            tensors=tensors,
            forks=forks,
            skipped_blocks=skipped_blocks,
            kind=kind,
            stream_of=stream_of,
        )

    @classmethod
    def from_tensor(cls, data: torch.Tensor, *, vocab_size: int | None = None) -> KVPayload:
        """Decode a payload held in a contiguous 1-D uint8 tensor on any device (the
        ``device`` KV transport's buffers): the same checks as ``from_bytes``, its header
        read from a small CPU copy of the first bytes, its tensors views of ``data``."""
        return cls.from_bytes(data, vocab_size=vocab_size)

    def check_compatible(self, *, model_fingerprint: str, dtype: str, block_size: int,
                         num_layers: int) -> None:
        """Raise KVPayloadError naming the first field that does not match the receiver."""
        for field_name, mine, theirs in (
            ("model_fingerprint", model_fingerprint, self.model_fingerprint),
            ("dtype", dtype, self.dtype),
            ("block_size", block_size, self.block_size),
            ("num_layers", num_layers, self.num_layers),
        ):
            if mine != theirs:
                raise KVPayloadError(
                    f"KV payload {field_name} mismatch: payload has {theirs!r}, this engine {mine!r}"
                )
        if self.kind == "chunk":
            if len(self.token_ids) != self.num_prompt_tokens:
                raise KVPayloadError(f"KV chunk token_ids has {len(self.token_ids)} ids, expected "
                                     f"the {self.num_prompt_tokens} tokens of its blocks")
        elif len(self.token_ids) != self.num_prompt_tokens + 1:
            raise KVPayloadError(
                f"KV payload token_ids has {len(self.token_ids)} ids, expected prompt "
                f"({self.num_prompt_tokens}) plus one first token"
            )


def write_payload(payload: KVPayload, source: Any, block_table: list[int], state_slot: int,
                  num_tokens: int, buffer_for: Any, key: str, first_block: int = 0) -> Any:
    """Lay ``payload`` out and gather its KV (the blocks of ``block_table`` from
    ``first_block`` on, and the slot's rings) straight into the buffer
    ``buffer_for(key, nbytes)`` returns (a transport's own memory): one copy. Returns
    that buffer, filled. ``source``: what holds the KV (``export_shapes``,
    ``export_into``: a ModelRunner, or its KVCache itself)."""
    layout = payload.layout(source.export_shapes(num_tokens, first_block))
    buffer = buffer_for(key, layout.nbytes)
    source.export_into(block_table, state_slot, num_tokens, layout.write(buffer), first_block)
    return buffer
