"""Decode-shaped fp32 matmuls on the CPU: a few rows times a large weight.

    panels = pack(weight)                      # [N, K] -> [P, K, 16], once at load
    out = matmul(x, panels, n=weight.shape[0], bias=None)   # x [M, K] -> [M, N]

Why: a decode step multiplies ~16 rows by every weight of the model, so it is a stream
of the weights through the cores with 16 FMAs per weight element. MKL's and oneDNN's
kernels for that shape keep too few loads in flight to use the memory bandwidth (small
model, 16 rows, 2 threads: ~28 ms for 315 MB of weights, against 15 ms to read them).
Here the weight is stored as 16-column panels, each contiguous over K, and a thread
runs a block of them against a few rows at a time with every accumulator in a
register (``skinny_block.h``: 8 rows x 2 panels on AVX-512, 4 rows x 1 panel on AVX2),
prefetching the panels ahead; threads split the panels (OpenMP, torch's own runtime, so
``torch.set_num_threads`` applies). One source serves every ISA (``simd.h``); numbers
below are the AVX-512 build's. All decode matmuls of the small model
at 16 rows, best of 8 alternated runs: 15.1 ms (20.9 GB/s of weights: the machine's
read bandwidth) vs 24.2 ms for oneDNN's packed weights with 2 threads; 27.8 vs 40.9 ms
with 1 thread (11.3 GB/s, one core's bandwidth). Tiny model: 1.2 vs 1.8-2.3 ms.

Sums run over K in order, so results differ from MKL's in the last bits (as MKL's
differ between its own kernels); the engine's greedy tokens still equal transformers'.

The C source beside this file is compiled on first use (``kernels/cbuild.py``) for the
host's ISA, or the one asked for (``isa``); where that is not possible, ``available()``
is False and callers keep their torch matmuls.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import cbuild

PANEL = 16


def _library(isa: str | None = None) -> ctypes.CDLL | None:
    return _built(cbuild.resolve_isa(isa))


@functools.cache
def _built(isa: str) -> ctypes.CDLL | None:
    lib = cbuild.load("skinny_gemm", isa)
    if lib is not None:
        lib.skinny_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p]
        lib.skinny_gemm.restype = ctypes.c_int
        # its quantized twins (kernels/quant_panels.py: fp32 or int8 rows), in the same library
        for quantized in (lib.skinny_gemm_q8, lib.skinny_gemm_dots):
            quantized.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_void_p]
            quantized.restype = ctypes.c_int
        lib.simd_dot.restype = ctypes.c_char_p
        lib.q_gather_columns.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 7 + [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.q_gather_columns.restype = ctypes.c_int
    return lib


def available(isa: str | None = None) -> bool:
    return _library(isa) is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> panels [P, K, 16] with P even (columns past N are zero)."""
    n, k = weight.shape
    p = -(-n // (2 * PANEL)) * 2
    padded = weight.new_zeros(p * PANEL, k)
    padded[:n] = weight
    return padded.view(p, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, panels: torch.Tensor, n: int,
           bias: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x [M, K] fp32 on the CPU, W given as ``pack(W)``;
    ``isa``: which build (default: the host's, ``cbuild.host_isa``)."""
    lib = _library(isa)
    if lib is None:
        raise RuntimeError(f"skinny_gemm ({cbuild.resolve_isa(isa)}) is not available on "
                           "this machine")
    x = x.contiguous()
    m, k = x.shape
    if panels.shape[1] != k or panels.shape[0] * PANEL < n or x.dtype != torch.float32:
        raise ValueError(f"x [{m}, {k}] {x.dtype} does not fit fp32 panels "
                         f"{tuple(panels.shape)} for n={n}")
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        b = None if bias is None else bias.contiguous()
        rc = lib.skinny_gemm(x.data_ptr(), m, k, panels.data_ptr(), n,
                             None if b is None else b.data_ptr(), out.data_ptr())
        if rc != 0:
            raise MemoryError("skinny_gemm could not allocate its scratch rows")
    return out


@torch.library.custom_op("pdserve::skinny_matmul", mutates_args=())
def skinny_matmul(x: torch.Tensor, panels: torch.Tensor, n: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``matmul`` as an operator, so that a ``torch.compile`` graph can call it."""
    return matmul(x, panels, n, bias)


@skinny_matmul.register_fake
def _(x, panels, n, bias):
    return x.new_empty(x.shape[0], n)
