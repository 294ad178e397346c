"""A Llama-family decoder, top to bottom, running on the paged KV cache.

Module names match Hugging Face checkpoints (``model.layers.3.self_attn.q_proj``),
so weights load by name; ``CausalLM.fuse`` then swaps each layer's projections for
fused matmuls (q|k|v, gate|up) with packed weights (see ``MatMul``). Input is a step's flat token list (rows back to back)
with absolute positions; attention metadata says where each row's keys live.

    h = embed(tokens)
    for each layer:
        x = rmsnorm(h); q, k, v = split(x @ Wqkv); (qwen3: q, k = rmsnorm per head)
        q, k = rope(q, k, positions); h += o_proj(attention(q, k, v, cache, meta))
        g, u = split(rmsnorm(h) @ Wgate_up); h += (silu(g) * u) @ Wdown
    logits = lm_head(rmsnorm(h))       # only at rows that sample
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.weights import load_checked
from pdserve.kernels.attention import AttentionMetadata, attention_step
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.norms import RMSNorm
from pdserve.kernels.rope import RopeTable, apply_rope_signed, inv_frequencies
from torch import nn


def _onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


class MatMul(nn.Module):
    """``x @ W.T (+ b)`` for 2-D ``x`` [T, in]; ``fuse`` concatenates projections that
    read the same input (q|k|v, gate|up), so a layer runs 4 matmuls instead of 7.

    On CPU in fp32 the weight is also kept in oneDNN's packed (blocked) layout, used
    for inputs of at most ``PACKED_MAX_ROWS`` rows (decode steps). Why: a decode step
    multiplies ~16 rows by every weight, so it streams all weights from memory once
    per step; with a plain weight MKL re-packs it on every call, which costs about as
    much again. Measured on the 82M model's weights (1 thread, 16 rows): 41 ms packed
    vs 51 ms ``F.linear`` vs 21 ms to merely read them. At prefill shapes (2048 rows)
    MKL's ``F.linear`` on the plain weight was ~13% faster than oneDNN (2.56 s vs
    2.96 s of the small model's prefill), hence both copies: the weights take twice
    their size in memory on this path. Elsewhere (GPU, bf16/fp16): ``F.linear`` only.
    """

    PACK_BATCH_HINT = 16  # oneDNN picks its blocking for about this many rows
    PACKED_MAX_ROWS = 128

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.packed = None
        if (weight.device.type == "cpu" and weight.dtype == torch.float32
                and _onednn_packing_available()):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_BATCH_HINT)

    @classmethod
    def fuse(cls, linears: list[nn.Linear]) -> MatMul:
        w = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
        if all(m.bias is None for m in linears):
            return cls(w, None)
        b = torch.cat([m.bias if m.bias is not None else w.new_zeros(m.out_features)
                       for m in linears])
        return cls(w, b)

    def weight_bytes(self) -> int:
        """Bytes one multiplication reads (one copy of the weight)."""
        return self.out_features * self.in_features * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= self.PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.scale = cfg.head_dim ** -0.5
        # transformers: qwen2 always has q/k/v bias and no o bias; mistral has none.
        bias = cfg.family == "qwen2" or (cfg.family != "mistral" and cfg.attention_bias)
        o_bias = cfg.family in ("llama", "qwen3") and cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def fuse(self) -> None:
        """Replace q/k/v by one [hidden, (Hq + 2 Hk) * D] matmul (see ``MatMul``)."""
        self.qkv = MatMul.fuse([self.q_proj, self.k_proj, self.v_proj])
        self.o = MatMul.fuse([self.o_proj])
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def forward(self, x, cos, sin, cache: KVCache, meta: AttentionMetadata):
        t, hq, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x).view(t, hq + 2 * hk, d)
        v = qkv[:, hq + hk:]
        if self.qk_norm:
            q, k = self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq:hq + hk])
            q, k = apply_rope_signed(q, cos, sin), apply_rope_signed(k, cos, sin)  # sin: signed
        else:  # one rotation for the q and k heads together (same cos/sin per token)
            qk = apply_rope_signed(qkv[:, :hq + hk], cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
        out = attention_step(q, k, v, self.layer, cache, meta, self.scale)
        return self.o(out.reshape(t, hq * d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        b = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=b)

    def fuse(self) -> None:
        """gate and up as one [hidden, 2 * intermediate] matmul; down pre-transposed."""
        self.gate_up = MatMul.fuse([self.gate_proj, self.up_proj])
        self.down = MatMul.fuse([self.down_proj])
        self.intermediate = self.gate_proj.out_features
        del self.gate_proj, self.up_proj, self.down_proj

    def forward(self, x):
        gu = self.gate_up(x)
        i = self.intermediate
        return self.down(F.silu(gu[:, :i]).mul_(gu[:, i:]))  # in place: one fewer [T, I]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, cache, meta):
        # Residual adds into the fresh sublayer outputs (a + b == b + a exactly): no
        # new [T, hidden] tensor per add.
        h = self.self_attn(self.input_layernorm(h), cos, sin, cache, meta).add_(h)
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RopeTable | None = None  # set by init_rope (not a weight)

    def init_rope(self, device: str | torch.device) -> None:
        r = self.cfg.rope
        with torch.device("cpu"):
            inv = inv_frequencies(self.cfg.head_dim, r.theta, r.rope_type, r.factor,
                                  r.low_freq_factor, r.high_freq_factor,
                                  r.original_max_position_embeddings)
        self.rope = RopeTable(inv.to(device))

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self.named_parameters(remove_duplicate=False)}

    def fuse(self) -> None:
        """After loading by checkpoint names: fused, packed matmul weights (the
        originals are dropped, so memory does not double)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.logits_proj = MatMul.fuse([self.lm_head])
        del self.lm_head

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """tokens, positions: [T] -> final hidden states [T, hidden] (after the last norm)."""
        h = self.model.embed_tokens(tokens)
        # sin comes with its first half negated (see apply_rope_signed).
        cos, sin = self.rope.cos_sin(positions, h.dtype, meta.max_position, signed=True)
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache, meta)
        return self.model.norm(h)

    def matmul_weight_bytes(self) -> int:
        """Bytes of every matmul weight: what a decode step reads at least once."""
        return sum(m.weight_bytes() for m in self.modules() if isinstance(m, MatMul))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_proj(hidden).float()


def load_model(model_dir, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[ModelConfig, CausalLM]:
    """Build the model for ``model_dir``'s config.json and load its checked weights."""
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = model.expected_shapes()
    optional = frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset()
    state = load_checked(model_dir, expected, dtype, device, optional)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope(device)
    model.fuse()
    return cfg, model.eval().requires_grad_(False)
