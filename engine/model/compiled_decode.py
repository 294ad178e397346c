"""Decode steps of a ``CausalLM`` with each layer's dense work in ``torch.compile``d
blocks (``compile=True``, ``CausalLM.use_compiled``); ``engine/model/llama.py`` is the
reference it is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.model.llama import CausalLM, MatMul, linear
from pdserve.kernels.attention import as_held, attention_step


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin[:, None, :]


def _pre(h, cos, sin, ln_w, qkv_w, qkv_b, eps: float, hq: int, hk: int, d: int):
    """rmsnorm -> fused qkv matmul -> rope: q [T, Hq, D], k, v [T, Hk, D]."""
    t = h.shape[0]
    x = F.rms_norm(h, ln_w.shape, ln_w, eps)
    qkv = linear(x, qkv_w, qkv_b).view(t, hq + 2 * hk, d)
    qk = _rope(qkv[:, :hq + hk], cos, sin)
    return qk[:, :hq], qk[:, hq:], qkv[:, hq + hk:]


def _post(attn, h, o_w, o_b, ln2_w, gu_w, gu_b, dn_w, dn_b, eps: float,
          inter: int):
    """o_proj + residual, rmsnorm, gate|up, silu * up, down + residual; attn [T, Hq * D]."""
    h = linear(attn, o_w, o_b) + h
    gu = linear(F.rms_norm(h, ln2_w.shape, ln2_w, eps), gu_w, gu_b)
    return linear(F.silu(gu[:, :inter]) * gu[:, inter:], dn_w, dn_b) + h


def _post_pre(attn, h, cos, sin, o_w, o_b, ln2_w, gu_w, gu_b, dn_w, dn_b,
              ln_w, qkv_w, qkv_b, eps: float, inter: int, hq: int, hk: int, d: int):
    h = _post(attn, h, o_w, o_b, ln2_w, gu_w, gu_b, dn_w, dn_b, eps, inter)
    q, k, v = _pre(h, cos, sin, ln_w, qkv_w, qkv_b, eps, hq, hk, d)
    return h, q, k, v


def _post_final(attn, h, o_w, o_b, ln2_w, gu_w, gu_b, dn_w, dn_b, norm_w,
                eps: float, inter: int):
    h = _post(attn, h, o_w, o_b, ln2_w, gu_w, gu_b, dn_w, dn_b, eps, inter)
    return F.rms_norm(h, norm_w.shape, norm_w, eps)


def _decode_step(h, cos, sin, weights: list, eps: float, inter: int, hq: int, hk: int,
                 d: int, scale: float, k_blocks: list, v_blocks: list, kcs: list, vcs: list,
                 slot_mapping, slots, positions, mask, length: int):
    """A whole decode step (every layer, attention included) for an identity plan:
    row i lives in slot i of the contiguous K/V ``kcs``/``vcs`` [S, Hk, C, D]."""
    n = h.shape[0]
    g = hq // hk
    for i in range(len(weights)):
        ln_w, qkv_w, qkv_b, o_w, o_b, ln2_w, gu_w, gu_b, dn_w, dn_b = weights[i]
        kb, vb, kc, vc = k_blocks[i], v_blocks[i], kcs[i], vcs[i]
        q, k, v = _pre(h, cos, sin, ln_w, qkv_w, qkv_b, eps, hq, hk, d)
        nb, bs = kb.shape[:2]
        k, v = as_held(k, kb.dtype), as_held(v, vb.dtype)
        kb.view(nb * bs, hk, d).index_copy_(0, slot_mapping, k.to(kb.dtype))
        vb.view(nb * bs, hk, d).index_copy_(0, slot_mapping, v.to(vb.dtype))
        kc[slots, :, positions] = k
        vc[slots, :, positions] = v
        kk = kc.view(-1, kc.shape[2], d)[:n * hk, :length]
        vv = vc.view(-1, vc.shape[2], d)[:n * hk, :length]
        scores = torch.bmm(q.reshape(n * hk, g, d), kk.transpose(1, 2)) * scale
        if mask is not None:
            scores = (scores.view(n, hk, g, length) + mask[:n]).view(n * hk, g, length)
        attn = torch.bmm(scores.softmax(dim=-1), vv).view(n, hq * d)
        h = _post(attn, h, o_w, o_b, ln2_w, gu_w, gu_b, dn_w, dn_b, eps, inter)
    return h


class CompiledDecode:
    """Decode steps with each layer's dense work (norms, matmuls, rope, MLP) in
    ``torch.compile``d blocks: one between consecutive layers' attentions (post of
    layer i + pre of layer i+1), so the Python dispatch of ~15 small ops per layer
    becomes one call. Attention (KV writes, the contiguous decode K/V) stays eager:
    its length changes every step. Weights are passed as arguments, so one graph
    serves every layer. Matmuls read ``MatMul.decode_operand`` (skinny_gemm's panels
    through its operator, else ``W.T`` for MKL's mm)."""

    def __init__(self, model: CausalLM):
        """Built for ``model`` (then ``model.use_compiled(this)``); its matmuls then read
        panels or ``W.T``: a packed weight cannot enter the graph."""
        for layer in model.model.layers:
            for mm in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down):
                if mm.packed is not None:
                    mm.use_transposed()
        self.model = model
        cfg = model.cfg
        self.eps = cfg.rms_norm_eps
        # Automatic dynamic shapes: the first graph is static, a second row count
        # recompiles with the row count symbolic (weights stay static). Dynamo also
        # guards on torch's thread count, so ThreadTuner's 1 / N threads make one
        # graph each (their C++ kernels then use that many threads).
        opts = dict(dynamic=None, fullgraph=True)
        self.pre = torch.compile(_pre, **opts)
        self.post_pre = torch.compile(_post_pre, **opts)
        self.post_final = torch.compile(_post_final, **opts)
        self.step = torch.compile(_decode_step, **opts)
        self._weights = None
        self._marked = None

    def supports(self, cache, meta) -> bool:
        m = self.model
        return (not m.cfg.qk_norm and not cache.ring_layers and m.model.norm.weight.dtype == torch.float32
                and len(meta.groups) == 1 and meta.groups[0].decode)

    @staticmethod
    def _w(mm: MatMul):
        # Not oneDNN's packed weight: inductor cannot take it (``enable_compile``
        # switched those to W.T).
        return mm.decode_operand(), mm.bias

    def run(self, tokens, positions, cache, meta):
        m = self.model
        layers = m.model.layers
        eps = self.eps
        h = m.model.embed_tokens(tokens)
        cos, sin = m.rope.cos_sin(positions, h.dtype, meta.max_position, signed=True)
        plan = meta.decode_plan
        if plan is not None and plan.identity and meta.groups[0].covers_all:
            return self._run_whole(h, cos, sin, cache, meta, plan)
        a0 = layers[0].self_attn
        q, k, v = self.pre(h, cos, sin, layers[0].input_layernorm.weight, *self._w(a0.qkv),
                           eps, a0.num_heads, a0.num_kv_heads, a0.head_dim)
        for i, layer in enumerate(layers):
            at = layer.self_attn
            out = attention_step(q, k, v, at.layer, cache, meta, at.scale).flatten(1)
            mlp = layer.mlp
            common = (*self._w(at.o), layer.post_attention_layernorm.weight, *self._w(mlp.gate_up),
                      *self._w(mlp.down))
            if i + 1 < len(layers):
                nxt = layers[i + 1]
                na = nxt.self_attn
                h, q, k, v = self.post_pre(out, h, cos, sin, *common, nxt.input_layernorm.weight,
                                           *self._w(na.qkv), eps, mlp.intermediate,
                                           na.num_heads, na.num_kv_heads, na.head_dim)
            else:
                h = self.post_final(out, h, *common, m.model.norm.weight, eps, mlp.intermediate)
        return h

    def _run_whole(self, h, cos, sin, cache, meta, plan):
        m = self.model
        layers = m.model.layers
        if self._weights is None:
            self._weights = [
                (ly.input_layernorm.weight, *self._w(ly.self_attn.qkv), *self._w(ly.self_attn.o),
                 ly.post_attention_layernorm.weight, *self._w(ly.mlp.gate_up),
                 *self._w(ly.mlp.down)) for ly in layers]
        dkv = meta.decode_kv
        # Row count, slots, capacity and key length change during a run: symbolic from
        # the first compile, so the graph is not compiled again as they grow.
        mark = torch._dynamo.maybe_mark_dynamic
        for t in (h, cos, sin, meta.slot_mapping, plan.slots, plan.positions):
            mark(t, 0)
        if plan.mask is not None:
            mark(plan.mask, 0), mark(plan.mask, 3)
        if self._marked is not dkv.k[0]:  # the copies were (re)allocated
            for t in (*dkv.k, *dkv.v):
                mark(t, 0), mark(t, 2)
            self._marked = dkv.k[0]
        dkv.fill_all_layers(plan)
        a0 = layers[0].self_attn
        h = self.step(h, cos, sin, self._weights, self.eps, layers[0].mlp.intermediate,
                      a0.num_heads, a0.num_kv_heads, a0.head_dim, a0.scale, cache.k_blocks,
                      cache.v_blocks, dkv.k, dkv.v, meta.slot_mapping, plan.slots,
                      plan.positions, plan.mask, plan.length)
        return F.rms_norm(h, m.model.norm.weight.shape, m.model.norm.weight, self.eps)
