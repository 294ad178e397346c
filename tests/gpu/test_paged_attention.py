"""The paged attention kernel against a per-row torch reference, for every kind of row a
step holds: decode rows (split over their keys or not), prompt chunks over cached
blocks, fresh prompts, grouped heads, sliding windows, ring layers, padding rows."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdserve.kernels.gpu.attention import decode_splits, paged_attention


def reference(q, keys_of, q_lens, seq_lens, scale, window=None):
    """Row by row: keys_of(r, positions) -> (k, v) [n, Hk, D]."""
    out = torch.empty_like(q)
    t0 = 0
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        k, v = keys_of(r, list(range(sl)))
        qr = q[t0:t0 + ql].float()
        g = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(g, 1)
        v = v.float().repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qr, k) * scale
        qp = torch.arange(sl - ql, sl)[:, None]
        kp = torch.arange(sl)[None, :]
        seen = kp <= qp
        if window is not None:
            seen &= qp - kp < window
        s = s.masked_fill(~seen, float("-inf"))
        out[t0:t0 + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
        t0 += ql
    return out


def paged_case(q_lens, seq_lens, hq, hk, d, page, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = len(q_lens)
    need = [math.ceil(s / page) for s in seq_lens]
    num_blocks = 1 + sum(need) + 3
    kc = torch.randn(num_blocks, page, hk, d, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, page, hk, d, generator=gen).to(dtype)
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)  # blocks out of order, as a pool hands them out
    width = max(need) + 2
    tables = torch.zeros(rows, width, dtype=torch.int32)
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor([ids.pop() for _ in range(n)])
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)

    def keys_of(r, pos):
        slots = [int(tables[r, p // page]) * page + p % page for p in pos]
        return (kc.view(-1, hk, d)[slots], vc.view(-1, hk, d)[slots])

    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    dev = {"device": device}
    return (q.to(**dev), kc.to(**dev), vc.to(**dev), tables.to(**dev), cu.to(**dev),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), keys_of, q)


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (6, 2)])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_rows(device, hq, hk, splits):
    q_lens, seq_lens = [1, 1, 1, 1], [1, 17, 70, 200]
    q, kc, vc, tables, cu, sl, keys_of, q_host = paged_case(
        q_lens, seq_lens, hq, hk, 32, 16, torch.float32, device)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, out, cu, sl, 1, 0.2, tables=tables, num_splits=splits)
    want = reference(q_host, keys_of, q_lens, seq_lens, 0.2)
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=1e-5)


def test_mixed_step_chunks_fresh_and_decode(device):
    """A fresh prompt, a chunk over cached blocks (chunked prefill, prefix-cache hit),
    decode rows, and head dim 48 (padded to 64 inside)."""
    q_lens, seq_lens = [37, 1, 20, 1], [37, 90, 100, 5]
    q, kc, vc, tables, cu, sl, keys_of, q_host = paged_case(
        q_lens, seq_lens, 8, 2, 48, 16, torch.float32, device, seed=1)
    out = torch.empty_like(q)
    paged_attention(q, kc, vc, out, cu, sl, 37, 0.15, tables=tables)
    torch.testing.assert_close(out.cpu(), reference(q_host, keys_of, q_lens, seq_lens, 0.15),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_sliding_window_over_pages(device, splits):
    q_lens, seq_lens = [1, 30, 1], [150, 130, 9]
    q, kc, vc, tables, cu, sl, keys_of, q_host = paged_case(
        q_lens, seq_lens, 4, 2, 32, 8, torch.float32, device, seed=2)
    out = torch.empty_like(q)
    paged_attention(q, kc, vc, out, cu, sl, 30, 0.3, tables=tables, window=24,
                    num_splits=splits)
    torch.testing.assert_close(out.cpu(), reference(q_host, keys_of, q_lens, seq_lens, 0.3, 24),
                               atol=2e-5, rtol=1e-5)


def test_ring_layer_decode_rows(device):
    """Keys in state slots' rings (position p at row slot * R + p % R)."""
    ring_len, window, hk, d = 40, 32, 2, 32
    gen = torch.Generator().manual_seed(3)
    kr = torch.randn(5 * ring_len, hk, d, generator=gen)
    vr = torch.randn(5 * ring_len, hk, d, generator=gen)
    slots, seq_lens = [3, 1, 4], [100, 7, 41]
    q = torch.randn(3, 8, d, generator=gen)

    def keys_of(r, pos):
        # positions beyond the ring's reach are masked by the window; any row will do
        rows = [slots[r] * ring_len + p % ring_len for p in pos]
        return kr[rows], vr[rows]

    out = torch.empty_like(q)
    cu = torch.arange(4, dtype=torch.int32)
    paged_attention(q.to(device), kr.to(device), vr.to(device), out := out.to(device),
                    cu.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), 1,
                    0.25, slots=torch.tensor(slots, dtype=torch.int32, device=device),
                    ring_len=ring_len, window=window, num_splits=2)
    torch.testing.assert_close(out.cpu(), reference(q, keys_of, [1, 1, 1], seq_lens, 0.25, window),
                               atol=2e-5, rtol=1e-5)


def test_bf16_within_rounding(device):
    q_lens, seq_lens = [1, 9], [300, 40]
    q, kc, vc, tables, cu, sl, keys_of, q_host = paged_case(
        q_lens, seq_lens, 8, 4, 64, 16, torch.bfloat16, device, seed=4)
    out = torch.empty_like(q)
    paged_attention(q, kc, vc, out, cu, sl, 9, 0.125, tables=tables, num_splits=2)
    want = reference(q_host, keys_of, q_lens, seq_lens, 0.125)
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)


def test_padding_rows_never_touch_real_rows(device):
    """A graph's padding rows (one key in block 0) beside real rows: the real rows'
    output is unchanged, the padding rows' output is finite."""
    q_lens, seq_lens = [1, 1, 1, 1], [50, 3, 1, 1]
    q, kc, vc, tables, cu, sl, keys_of, q_host = paged_case(
        q_lens, seq_lens, 4, 4, 32, 16, torch.float32, device, seed=5)
    tables[2:] = 0
    out = torch.empty_like(q)
    paged_attention(q, kc, vc, out, cu, sl, 1, 0.2, tables=tables, num_splits=4)
    assert torch.isfinite(out).all()
    want = reference(q_host[:2], keys_of, q_lens[:2], seq_lens[:2], 0.2)
    torch.testing.assert_close(out[:2].cpu(), want, atol=2e-5, rtol=1e-5)


def test_decode_splits_fill_the_device():
    assert decode_splits(1, 8, 132) == 16  # one 8B row: capped
    assert decode_splits(64, 8, 132) == 1
    assert decode_splits(4, 8, 132) == 9
