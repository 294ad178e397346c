"""Each fused layer op against the torch reference it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.attention import write_blocks_kv
from pdserve.kernels.gpu import layer_ops
from pdserve.kernels.norms import rms_norm
from pdserve.kernels.rope import RopeTable, apply_rope_signed, inv_frequencies

DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)]  # bf16: about two units in the last place


def _randn(*shape, dtype, device, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n", [256, 576])
def test_rms_norm_and_residual_add(device, dtype, tol, n):
    x = _randn(5, n, dtype=dtype, device=device)
    res = _randn(5, n, dtype=dtype, device=device, seed=1)
    w = _randn(n, dtype=dtype, device=device, seed=2)
    torch.testing.assert_close(layer_ops.rms_norm(x, w, 1e-5).cpu(),
                               rms_norm(x, w, 1e-5).cpu(), atol=tol, rtol=tol)
    summed = (x + res).cpu()
    out = layer_ops.rms_norm(x, w, 1e-5, residual=res)
    # the stream holds the sum (Triton's interpreter truncates to bf16 where a GPU rounds)
    torch.testing.assert_close(res.cpu(), summed, atol=0 if dtype == torch.float32 else tol,
                               rtol=0 if dtype == torch.float32 else tol)
    torch.testing.assert_close(out.cpu(), rms_norm(summed, w.cpu(), 1e-5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("d", [64, 80])
def test_rope_in_place_on_the_qk_heads_of_a_qkv_view(device, dtype, tol, d):
    hq, hk, t = 6, 2, 7
    table = RopeTable(inv_frequencies(d, 10000.0).to(device), initial=64)
    positions = torch.tensor([0, 3, 9, 63, 200, 5, 1], device=device)  # 200: the table grows
    qkv = _randn(t, hq + 2 * hk, d, dtype=dtype, device=device)
    cos, sin = table.cos_sin(positions, dtype, signed=True)
    want = apply_rope_signed(qkv[:, :hq + hk].cpu(), cos.cpu(), sin.cpu())
    v_before = qkv[:, hq + hk:].clone()
    layer_ops.rope_(qkv[:, :hq + hk], positions, *table.tables(dtype, 200))
    torch.testing.assert_close(qkv[:, :hq + hk].cpu(), want, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, hq + hk:], v_before)  # the v heads are not touched


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_mul(device, dtype, tol):
    gu = _randn(3, 2 * 1536, dtype=dtype, device=device) * 4
    want = F.silu(gu[:, :1536].cpu()) * gu[:, 1536:].cpu()
    torch.testing.assert_close(layer_ops.silu_mul(gu).cpu(), want, atol=tol, rtol=tol)


def test_write_kv_into_pages_and_skip_dropped_rows(device):
    hq, hk, d = 4, 2, 32
    qkv = _randn(5, hq + 2 * hk, d, dtype=torch.float32, device=device)
    k, v = qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    kc = torch.zeros(6, 4, hk, d, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([5, 9, 10, 23, 1], device=device)
    layer_ops.write_kv(k, v, kc, vc, slots.to(torch.int32))
    kr, vr = torch.zeros_like(kc).cpu(), torch.zeros_like(vc).cpu()
    write_blocks_kv(kr, vr, slots.cpu(), k.cpu(), v.cpu())
    assert torch.equal(kc.cpu(), kr) and torch.equal(vc.cpu(), vr)
    ring = torch.zeros(8, hk, d, device=device)
    ring_v = torch.zeros_like(ring)
    layer_ops.write_kv(k, v, ring, ring_v, torch.tensor([-1, 3, -1, 0, 7], dtype=torch.int32,
                                                        device=device))
    assert torch.equal(ring[3].cpu(), k[1].cpu()) and torch.equal(ring_v[7].cpu(), v[4].cpu())
    assert int((ring != 0).any(-1).any(-1).sum()) == 3  # rows -1 wrote nothing
