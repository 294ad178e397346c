"""The tensor section of a KV payload: its entries as the header lists them (each
checked before any byte is read), its layout when a sender writes it, and its tensors
as views of the payload's bytes when a receiver reads it (no copies).

The section follows the header at a 64-byte aligned offset; each entry names a tensor
with its dtype, shape, offset and length inside the section, and the entries tile
the section exactly.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

MAX_TENSORS = 1024
MAX_TENSOR_DIMS = 8

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class KVPayloadError(ValueError):
    """A payload that cannot be imported; the message names what is wrong."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise KVPayloadError(f"dtype {dtype} cannot be carried in a KV payload")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def check_tensor_specs(entries: list, tensor_bytes: int) -> list[TensorSpec]:
    """Every entry well formed, inside the tensor section, sized by its shape, and the
    entries tiling the section exactly (no overlap, no gap, no duplicate name)."""
    if len(entries) > MAX_TENSORS:
        raise KVPayloadError(f"KV payload names {len(entries)} tensors, more than {MAX_TENSORS}")
    specs: list[TensorSpec] = []
    names: set[str] = set()
    for index, entry in enumerate(entries):
        specs.append(_check_tensor_entry(index, entry, names, tensor_bytes))
    _check_tiling(specs, tensor_bytes)
    return specs


def _check_tensor_entry(index: int, entry: Any, names: set[str],
                        tensor_bytes: int) -> TensorSpec:
    """One entry, its name new (added to ``names``) and its bytes inside the section."""
    where = f"KV payload tensors[{index}]"
    if not isinstance(entry, list) or len(entry) != 5:
        raise KVPayloadError(f"{where} must be [name, dtype, shape, offset, nbytes], "
                             f"got {entry!r:.200}")
    name, dtype, shape, offset, nbytes = entry
    if not isinstance(name, str):
        raise KVPayloadError(f"{where}: name must be a str, got {type(name).__name__}")
    where = f"KV payload tensor {name!r}"
    if name in names:
        raise KVPayloadError(f"{where} appears twice")
    names.add(name)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise KVPayloadError(f"{where}: unknown dtype {dtype!r}")
    if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
            or not all(is_int(d) and d >= 0 for d in shape)):
        raise KVPayloadError(f"{where}: shape must be a list of at most {MAX_TENSOR_DIMS} "
                             f"ints >= 0, got {shape!r:.200}")
    for label, value in (("offset", offset), ("nbytes", nbytes)):
        if not is_int(value) or value < 0:
            raise KVPayloadError(f"{where}: {label} must be an int >= 0, got {value!r}")
    if offset + nbytes > tensor_bytes:
        raise KVPayloadError(f"{where}: bytes [{offset}, {offset + nbytes}) lie outside "
                             f"the tensor section of {tensor_bytes} bytes")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes != expected:
        raise KVPayloadError(f"{where}: nbytes {nbytes} does not match shape {shape} of "
                             f"{dtype} ({expected} bytes)")
    return TensorSpec(name, dtype, tuple(shape), offset, nbytes)


def _check_tiling(specs: list[TensorSpec], tensor_bytes: int) -> None:
    end = 0
    for spec in sorted((s for s in specs if s.nbytes), key=lambda s: s.offset):
        if spec.offset < end:
            raise KVPayloadError(f"KV payload tensor {spec.name!r} overlaps the tensor before it "
                                 f"(offset {spec.offset} < {end})")
        end = spec.offset + spec.nbytes
    covered = sum(spec.nbytes for spec in specs)
    if covered != tensor_bytes:
        raise KVPayloadError(f"KV payload header field 'tensor_bytes' is {tensor_bytes}, but its "
                             f"tensors hold {covered} bytes")


@dataclass(frozen=True)
class PayloadLayout:
    """A payload's bytes before its tensors are filled in: the prefix and header
    (``head``), then each tensor at ``len(head) + spec.offset``."""

    head: bytes
    specs: list[TensorSpec]

    @property
    def nbytes(self) -> int:
        return len(self.head) + sum(spec.nbytes for spec in self.specs)

    def write(self, buffer: Any) -> dict[str, torch.Tensor]:
        """Write the head into ``buffer`` (writable, exactly ``nbytes`` long) and return
        its tensors as views of it, for the sender to fill. ``buffer`` may also be a
        contiguous 1-D uint8 tensor on any device: the head is copied in, and the views
        are tensors on that device."""
        if isinstance(buffer, torch.Tensor):
            check_byte_tensor(buffer)
            if buffer.numel() != self.nbytes:
                raise ValueError(f"a KV payload of {self.nbytes} bytes cannot be written into a "
                                 f"tensor of {buffer.numel()} bytes")
            buffer[:len(self.head)].copy_(torch.frombuffer(bytearray(self.head), dtype=torch.uint8))
            return tensor_views(DeviceBytes(buffer), len(self.head), self.specs)
        view = memoryview(buffer).cast("B")
        if len(view) != self.nbytes:
            raise ValueError(f"a KV payload of {self.nbytes} bytes cannot be written into a "
                             f"buffer of {len(view)}")
        view[:len(self.head)] = self.head
        return tensor_views(view, len(self.head), self.specs)


def check_byte_tensor(data: torch.Tensor) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise KVPayloadError(f"a KV payload tensor must be contiguous 1-D uint8, got "
                             f"{data.dtype} of shape {tuple(data.shape)}")


class DeviceBytes:
    """A payload in a uint8 tensor, read like bytes: slices are small CPU copies (the
    prefix and header); ``_views`` makes its tensors views of the tensor itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        check_byte_tensor(tensor)
        self.tensor = tensor

    def __len__(self) -> int:
        return self.tensor.numel()

    def __getitem__(self, index: slice) -> memoryview:
        return memoryview(self.tensor[index].cpu().numpy()).cast("B")

    def views(self, start: int, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        out = {}
        for spec in specs:
            torch_dtype = DTYPES[spec.dtype]
            begin = start + spec.offset
            flat = self.tensor[begin:begin + spec.nbytes]
            try:
                out[spec.name] = flat.view(torch_dtype).view(spec.shape)
            except RuntimeError as exc:  # an offset not a multiple of the element size
                raise KVPayloadError(f"KV payload tensor {spec.name!r} cannot be viewed as "
                                     f"{spec.dtype} at byte {begin}: {exc}") from None
        return out


def tensor_views(data: Any, start: int, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Each spec's tensor as a view of ``data`` (its offsets count from ``start``)."""
    if isinstance(data, DeviceBytes):
        return data.views(start, specs)
    tensors = {}
    with warnings.catch_warnings():  # a read-only buffer: the receiver only reads it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for spec in specs:
            torch_dtype = DTYPES[spec.dtype]
            if spec.nbytes == 0:  # torch.frombuffer refuses an empty buffer
                tensors[spec.name] = torch.empty(spec.shape, dtype=torch_dtype)
                continue
            flat = torch.frombuffer(data, dtype=torch_dtype,
                                    count=spec.nbytes // torch_dtype.itemsize,
                                    offset=start + spec.offset)
            tensors[spec.name] = flat.view(spec.shape)
    return tensors
