"""The KV hand-off payload: a versioned msgpack header followed by raw tensor bytes.

Layout of one payload (all integers little-endian):

    b"PDKV" | u16 version | u32 header length | msgpack header | tensor bytes

The header names every tensor with its dtype, shape, offset and length inside the
tensor section, so a receiver can check a payload completely before it allocates
anything, and a truncated payload is caught by arithmetic rather than by a crash.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

MAGIC = b"PDKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class KVPayloadError(ValueError):
    """A payload that cannot be imported; the message names what is wrong."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise KVPayloadError(f"dtype {dtype} cannot be carried in a KV payload")


@dataclass
class KVPayload:
    """Everything a COMPLETION engine needs to continue a prefilled request."""

    request_id: str
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

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens

    @property
    def first_token_id(self) -> int:
        return self.token_ids[-1]

    def to_bytes(self) -> bytes:
        specs, chunks, offset = [], [], 0
        for name, tensor in self.tensors.items():
            raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            data = raw.numpy().tobytes()
            specs.append([name, dtype_name(tensor.dtype), list(tensor.shape), offset, len(data)])
            chunks.append(data)
            offset += len(data)
        header = {
            "request_id": self.request_id,
            "model_fingerprint": self.model_fingerprint,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_tokens": self.num_prompt_tokens,
            "token_ids": self.token_ids,
            "sampling": self.sampling,
            "arrival_time": self.arrival_time,
            "first_token_time": self.first_token_time,
            "layout": "token-major [tokens, kv_heads, head_dim] per layer; ring [ring_len, kv_heads, head_dim]",
            "tensors": specs,
            "tensor_bytes": offset,
        }
        packed = msgpack.packb(header, use_bin_type=True)
        return b"".join([_PREFIX.pack(MAGIC, VERSION, len(packed)), packed, *chunks])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> KVPayload:
        data = memoryview(data)
        if len(data) < _PREFIX.size:
            raise KVPayloadError(f"KV payload truncated: {len(data)} bytes, no header")
        magic, version, header_len = _PREFIX.unpack(data[: _PREFIX.size])
        if magic != MAGIC:
            raise KVPayloadError("not a KV payload: bad magic bytes")
        if version != VERSION:
            raise KVPayloadError(f"KV payload version {version} is not supported (expected {VERSION})")
        body = _PREFIX.size + header_len
        if len(data) < body:
            raise KVPayloadError(f"KV payload truncated inside its header ({len(data)} < {body} bytes)")
        try:
            header = msgpack.unpackb(data[_PREFIX.size : body], raw=False)
        except Exception as exc:  # msgpack raises several types for garbage
            raise KVPayloadError(f"KV payload header is not valid msgpack: {exc}") from exc
        expected = body + header["tensor_bytes"]
        if len(data) != expected:
            raise KVPayloadError(
                f"KV payload truncated: {len(data)} bytes, header promises {expected}"
            )
        tensors = {}
        for name, dtype, shape, offset, nbytes in header["tensors"]:
            if dtype not in _DTYPES:
                raise KVPayloadError(f"tensor {name}: unknown dtype {dtype!r}")
            start = body + offset
            raw = torch.frombuffer(bytearray(data[start : start + nbytes]), dtype=torch.uint8)
            tensors[name] = raw.view(_DTYPES[dtype]).reshape(shape)
        return cls(
            request_id=header["request_id"],
            model_fingerprint=header["model_fingerprint"],
            dtype=header["dtype"],
            block_size=header["block_size"],
            num_layers=header["num_layers"],
            token_ids=list(header["token_ids"]),
            num_prompt_tokens=header["num_tokens"],
            sampling=header["sampling"],
            arrival_time=header["arrival_time"],
            first_token_time=header["first_token_time"],
            tensors=tensors,
        )

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
        if len(self.token_ids) != self.num_prompt_tokens + 1:
            raise KVPayloadError(
                f"KV payload token_ids has {len(self.token_ids)} ids, expected prompt "
                f"({self.num_prompt_tokens}) plus one first token"
            )
