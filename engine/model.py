"""A Llama-family decoder, top to bottom, running on the paged KV cache.

Module names match Hugging Face checkpoints (``model.layers.3.self_attn.q_proj``),
so weights load by name. Input is a step's flat token list (rows back to back)
with absolute positions; attention metadata says where each row's keys live.

    h = embed(tokens)
    for each layer:
        x = rmsnorm(h); q, k, v = proj(x); (qwen3: q, k = rmsnorm per head)
        q, k = rope(q, k, positions); h += o_proj(attention(q, k, v, cache, meta))
        h += down(silu(gate(rmsnorm(h))) * up(rmsnorm(h)))
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
from pdserve.kernels.rope import apply_rope, inv_frequencies, rope_cos_sin
from torch import nn


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

    def forward(self, x, cos, sin, cache: KVCache, meta: AttentionMetadata):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention_step(q, k, v, self.layer, cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        b = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=b)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


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
        self.inv_freq: torch.Tensor | None = None  # fp32, set by init_rope (not a weight)

    def init_rope(self, device: str | torch.device) -> None:
        r = self.cfg.rope
        with torch.device("cpu"):
            inv = inv_frequencies(self.cfg.head_dim, r.theta, r.rope_type, r.factor,
                                  r.low_freq_factor, r.high_freq_factor,
                                  r.original_max_position_embeddings)
        self.inv_freq = inv.to(device)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self.named_parameters(remove_duplicate=False)}

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """tokens, positions: [T] -> final hidden states [T, hidden] (after the last norm)."""
        h = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache, meta)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


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
    return cfg, model.eval().requires_grad_(False)
