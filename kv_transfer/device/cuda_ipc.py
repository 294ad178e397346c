"""CUDA IPC for the ``device`` backend: a prefill rank shares a payload's device memory,
and a decode rank on the same GPU maps it and copies it into its own blocks, with no
pair group, no socket and no host memory on the way.

Through the CUDA driver (``libcuda.so.1``, present wherever the NVIDIA driver is), not
torch's tensor sharing: torch's keeps the sender's block alive through a reference
count that the receiver gives back when it frees its tensor, so a receiver that dies
holding one leaks the block in the sender until the sender exits. Here the receiver
maps the sender's allocation only for the length of one import (``Mapper.mapped``), and
the driver unmaps it if the receiver dies; the sender's memory stays the sender's, freed
under the endpoint's release, discard and age rules like any other payload.

1. Share (sender): ``share(tensor)`` names the driver allocation holding the tensor (its
   base, from ``cuMemGetAddressRange``) by its 64-byte IPC handle, plus the tensor's
   offset in it and its length: an ``IpcHandle``. The tensor's writes are finished
   first (the device synchronized), so the receiver reads them whole.
2. Map (receiver): ``mapped(handle, device)`` opens the allocation (once per allocation
   however many imports use it at a time: a context may open a handle only once), and
   yields a uint8 tensor over the payload's bytes; on leaving, the receiver's device is
   synchronized (its copies out are done) and the allocation closed once its last user
   left.

What the driver refuses (another GPU behind ``CUDA_VISIBLE_DEVICES``, an allocation
made by ``cuMemCreate`` such as torch's expandable segments, containers that do not
share an IPC namespace) raises ``IpcRefused``: the transport then falls back to the
pair group.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class IpcRefused(RuntimeError):
    """The driver (or this process) cannot share or map the memory."""


@dataclass(frozen=True)
class IpcHandle:
    """Where one shared payload lies: an allocation's IPC handle on GPU ``gpu_uuid`` of
    node ``node_id``, and the payload's ``offset`` and ``nbytes`` inside it."""

    node_id: str
    gpu_uuid: str
    handle: bytes
    offset: int
    nbytes: int
    span: int  # the allocation's size: offset + nbytes never passes it

    def check(self, node_id: str, gpu_uuid: str, max_bytes: int) -> None:
        """Refuse (IpcRefused) a handle from another node or for a receiver off CUDA
        (``gpu_uuid`` ""), or (ValueError) one whose fields are out of bounds: a
        receiver maps nothing it was not meant to. Another GPU of the node is the
        driver's to refuse (peer access, ``CUDA_VISIBLE_DEVICES``)."""
        if not isinstance(self.handle, bytes) or len(self.handle) != HANDLE_BYTES:
            raise ValueError(f"an IPC handle is {HANDLE_BYTES} bytes")
        if not (0 <= self.offset and 0 < self.nbytes <= max_bytes
                and self.offset + self.nbytes <= self.span):
            raise ValueError(f"an IPC payload of {self.nbytes} bytes at {self.offset} of "
                             f"{self.span} (at most {max_bytes})")
        if self.node_id != node_id:
            raise IpcRefused("the payload lies on another node")
        if not gpu_uuid:
            raise IpcRefused("this rank is not on CUDA")

    def __repr__(self) -> str:  # the handle maps the sender's memory: never shown
        return f"IpcHandle({self.gpu_uuid!r}, offset={self.offset}, nbytes={self.nbytes})"


@functools.cache
def _driver() -> Any:
    """The CUDA driver, loaded once (``IpcRefused`` where there is none)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise IpcRefused(f"no CUDA driver: {exc}") from None


def _call(names: tuple[str, ...], *args: Any) -> None:
    """The first of ``names`` the driver has, called; a failure raises ``IpcRefused``."""
    lib = _driver()
    fn = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
    if fn is None:
        raise IpcRefused(f"the CUDA driver has no {names[0]}")
    rc = fn(*args)
    if rc != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(text))
        what = (text.value or b"").decode(errors="replace")
        raise IpcRefused(f"{names[0]} failed: CUDA error {rc} ({what})")


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class _CudaArray:
    """A device pointer as torch.as_tensor reads one (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2}


def gpu_uuid(device: Any) -> str:
    """The UUID of CUDA device ``device`` ("" for any other device)."""
    if device.type != "cuda":
        return ""
    # lazy: torch: the router's device transport imports this package
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def share(tensor: Any, node_id: str, gpu_uuid: str) -> IpcHandle:
    """An ``IpcHandle`` for a contiguous CUDA tensor's bytes (its writes finished first)."""
    # lazy: torch: the router's device transport imports this package
    import torch

    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise IpcRefused("only a contiguous CUDA tensor is shared by CUDA IPC")
    with torch.cuda.device(tensor.device):
        # every stream of this process on the device: the engine's gather may have run
        # on another thread's; this also makes the device's context current here
        torch.cuda.synchronize(tensor.device)
        ptr = tensor.data_ptr()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _call(("cuMemGetAddressRange_v2", "cuMemGetAddressRange"),
              ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        handle = _Handle()
        _call(("cuIpcGetMemHandle",), ctypes.byref(handle), base)
    return IpcHandle(node_id, gpu_uuid, bytes(handle.reserved), ptr - base.value,
                     tensor.numel() * tensor.element_size(), size.value)


class Mapper:
    """A receiver's mappings of senders' allocations, each opened once while in use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[bytes, tuple[int, int]] = {}  # handle -> (base pointer, users)

    @contextmanager
    def mapped(self, handle: IpcHandle, device: Any) -> Iterator[Any]:
        """A uint8 tensor on ``device`` over the shared payload, valid inside the block."""
        # lazy: torch: the router's device transport imports this package
        import torch

        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # makes the device's context current here
            base = self._acquire(handle.handle)
            try:
                yield torch.as_tensor(_CudaArray(base + handle.offset, handle.nbytes),
                                      device=device)
            finally:
                try:  # the copies out (on whichever thread's stream the import ran) done
                    torch.cuda.synchronize(device)
                finally:
                    self._leave(handle.handle)

    def num_open(self) -> int:
        with self._lock:
            return len(self._open)

    def _acquire(self, key: bytes) -> int:
        with self._lock:
            base, users = self._open.get(key, (0, 0))
            if not users:
                ptr, raw = ctypes.c_uint64(), _Handle.from_buffer_copy(key)
                _call(("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
                      ctypes.byref(ptr), raw, ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS))
                base = ptr.value
            self._open[key] = (base, users + 1)
            return base

    def _leave(self, key: bytes) -> None:
        with self._lock:
            base, users = self._open.pop(key)
            if users > 1:
                self._open[key] = (base, users - 1)
                return
        _call(("cuIpcCloseMemHandle",), ctypes.c_uint64(base))
