"""Token sampling for a batch of rows, vectorised: greedy, temperature, top-k, top-p,
and per-request seeds.

Reproducibility: a seeded row's randomness is a counter-based hash of
``(seed, output_index, token_id)``, computed with integer tensor ops. The token a
row draws therefore depends only on its own logits, settings, seed and output
index, never on which other rows share the batch, their order, or the device.
Unseeded rows get a fresh random seed per step from the caller's generator.
Sampling uses the Gumbel-max trick: ``argmax(logits / T + Gumbel)`` draws from
``softmax(logits / T)`` restricted to the top-k / top-p set.
Stop tokens are the scheduler's business, not this module's.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import cbuild

_M32 = 0xFFFFFFFF


def greedy(logits: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first maximal index of each row; a row holding NaN
    answers its first NaN), from ``argmax.c`` for fp32 CPU logits.

    Why: torch's CPU argmax over the last dimension is not vectorised: 77 µs for
    16 x 4096 fp32 here, and ~160 µs for an amax/sign/mul formulation under
    ``OMP_WAIT_POLICY=PASSIVE`` (each op wakes the thread team), against a few µs in
    C: ~5-10% of a tiny-model decode step. One pass that keeps each lane's best index
    (four chains), rows split over the threads from 8 rows: 16 x 49152 (the real model's
    vocabulary) 342 -> 50 µs, one row 28 -> 11 µs (AVX-512; AVX2 298 -> 50, 26 -> 11).
    Other dtypes and devices: torch's argmax.
    ``isa``: which build (``kernels/cbuild.py``; default the host's)."""
    lib = _argmax_library(cbuild.resolve_isa(isa))
    if lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" \
            or logits.dim() != 2 or logits.stride(-1) != 1:
        return logits.argmax(-1)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    lib.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                    out.data_ptr())
    return out


@functools.cache
def _argmax_library(isa: str) -> ctypes.CDLL | None:
    lib = cbuild.load("argmax", isa)
    if lib is not None:
        i64 = ctypes.c_int64
        lib.argmax_rows.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_void_p]
        lib.argmax_rows.restype = None
    return lib


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32) on int64 tensors holding [0, 2**32)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64 [B, vocab], a pure function of (seed, index, column).

    seeds: int64 [B] holding 64-bit seeds (any int64 value); output_index: int64 [B].
    """
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    key = mix32(lo ^ mix32(hi + 0x9E3779B9))
    key = mix32(key ^ mix32((output_index & _M32) + 0x85EBCA6B))
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = mix32(key[:, None] ^ mix32(cols[None, :] + 0xC2B2AE35))
    h2 = mix32(h ^ 0x27D4EB2F)
    bits = (h << 21) ^ (h2 & 0x1FFFFF)  # 53 random bits
    return (bits.double() + 0.5) / float(1 << 53)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k and nucleus (top-p) sets.

    top_k <= 0 disables it for a row; top_p >= 1 disables nucleus filtering.
    """
    vocab = x.shape[-1]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if not (need_k or need_p):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)
    if need_k:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = sorted_x.gather(1, (k - 1)[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if need_p:
        probs = sorted_x.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        sorted_x = sorted_x.masked_fill(before > top_p[:, None], float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens of each row whose probability is below min_p times the
    row's largest; min_p 0 leaves a row as it is."""
    probs = x.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return x.masked_fill(probs < floor, float("-inf"))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    output_index: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row. logits [B, V] (any float dtype); per-row settings [B].
    ``min_p`` (None: off for every row) drops tokens whose probability after
    temperature is below min_p times the row's most likely one's (vLLM's order:
    temperature, then min_p, then top-k and top-p)."""
    logits = logits.float()
    greedy_tokens = greedy(logits)
    sampled = temperature > 0
    if not bool(sampled.any()):
        return greedy_tokens
    temp = torch.where(sampled, temperature, torch.ones_like(temperature))
    x = logits / temp[:, None]
    if min_p is not None:
        x = apply_min_p(x, min_p)
    x = apply_top_k_top_p(x, top_k, top_p)
    u = seeded_uniform(seeds, output_index, x.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    drawn = (x.double() + gumbel).argmax(dim=-1)
    return torch.where(sampled, drawn, greedy_tokens)
