"""Decode steps of a ``CausalLM`` through ``kernels/decode_step`` (one C call per step).

Used for decode-only steps (attention reads the paged cache through the rows' block
tables, and sliding-window layers their rings; ``ModelRunner.prepare`` plans no
contiguous copy for them), when the model is fp32 on the CPU and every matmul has
``skinny_gemm`` panels (Llama, Mistral, Qwen2, Qwen3); built for the CPU's vector ISA
(AVX-512, AVX2 or neither, ``kernels/cbuild.py``) or the one asked for.
Other steps take the torch path.
"""

from __future__ import annotations

import torch

from pdserve.engine.model.quantized_weights import QuantEmbedding
from pdserve.kernels import decode_step
from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.kv_cache import KVCache


def build(model, isa: str | None = None) -> KernelDecode | None:
    """A kernel bound to ``model``'s fused weights (``isa``'s build; None: the host's),
    or None where it does not apply."""
    cfg = model.cfg
    layers = model.model.layers
    if not decode_step.available(isa) or model.model.norm.weight.dtype != torch.float32:
        return None
    mats = [(ly.self_attn.qkv, ly.self_attn.o, ly.mlp.gate_up, ly.mlp.down) for ly in layers]
    if any(m.panels is None and m.quant is None for group in mats for m in group):
        return None
    a = layers[0].self_attn
    dims = decode_step.StepDims(
        hidden=cfg.hidden_size, q_heads=a.num_heads, kv_heads=a.num_kv_heads,
        head_dim=a.head_dim, intermediate=layers[0].mlp.intermediate, layers=len(layers),
        eps=cfg.rms_norm_eps, scale=a.scale)
    if not dims.supported():
        return None
    weights = [decode_step.LayerWeights(
        ln=ly.input_layernorm.weight, qkv=_weight(qkv), qkv_bias=qkv.bias, o=_weight(o),
        o_bias=o.bias, ln2=ly.post_attention_layernorm.weight, gate_up=_weight(gu),
        gate_up_bias=gu.bias, down=_weight(down), down_bias=down.bias,
        q_norm=ly.self_attn.q_norm.weight if cfg.qk_norm else None,
        k_norm=ly.self_attn.k_norm.weight if cfg.qk_norm else None)
        for ly, (qkv, o, gu, down) in zip(layers, mats, strict=True)]
    embed = model.model.embed_tokens
    embedding = embed.quant if isinstance(embed, QuantEmbedding) else embed.weight
    if not isinstance(embed, QuantEmbedding) and (embedding.dtype != torch.float32
                                                   or not embedding.is_contiguous()):
        return None
    head = model.logits_proj  # its bias, if any, stays with the torch path
    step = decode_step.DecodeStep(dims, weights, model.model.norm.weight, embedding,
                                  _weight(head) if head.bias is None else None, head.out_features,
                                  cfg.layer_windows, isa)
    return KernelDecode(model, step)


def _weight(matmul):
    """What the step reads of a matmul: its quantized panels (a GGUF file's blocks,
    engine/model/quantized_weights.py) where it has them, else its fp32 panels."""
    return matmul.quant if matmul.quant is not None else matmul.panels


class KernelDecode:
    def __init__(self, model, step: decode_step.DecodeStep):
        self.model = model
        self.step = step
        self._bound: tuple[KVCache, decode_step.Stores] | None = None  # the cache last read

    @staticmethod
    def supports(cache: KVCache, meta: AttentionMetadata) -> bool:
        """A decode-only step whose rows come with their block tables (full-attention
        layers) and state slots (sliding-window layers): what ``ModelRunner.prepare``
        builds for decode steps when the kernel is on."""
        if len(meta.groups) != 1:
            return False
        g = meta.groups[0]
        return (g.decode and g.covers_all
                and (not cache.full_layers or g.block_tables is not None)
                and (not cache.ring_layers or g.state_slots is not None))

    @property
    def has_logits(self) -> bool:
        """Can ``run`` end with the logits (the LM head has panels and no bias)?"""
        return self.step.lm_head is not None

    def stores(self, cache: KVCache) -> decode_step.Stores:
        """The step's binding of ``cache`` (its stores are allocated once: bound once)."""
        if self._bound is None or self._bound[0] is not cache:
            # Each layer's store: its paged blocks, or its rings (sliding window).
            ks = [b if b is not None else r for b, r in zip(cache.k_blocks, cache.k_ring, strict=True)]
            vs = [b if b is not None else r for b, r in zip(cache.v_blocks, cache.v_ring, strict=True)]
            self._bound = (cache, self.step.bind(ks, vs, cache.ring_len))
        return self._bound[1]

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
            meta: AttentionMetadata, logits: bool = False,
            greedy: bool = False) -> decode_step.DecodeOutput:
        """Final hidden states [n, hidden]; the logits when ``logits`` and each row's argmax
        when ``greedy`` (only where ``has_logits``), else None."""
        cos, sin = self.model.rope.tables(torch.float32, meta.max_position)
        g = meta.groups[0]
        return self.step.run(tokens, positions, meta.max_position + 1, self.stores(cache), cos,
                             sin, g.block_tables, g.state_slots, logits, greedy)
