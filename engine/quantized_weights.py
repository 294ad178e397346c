"""A GGUF model's quantized matmul weights, kept as the file holds them for the C decode
step (``kernels/quant_panels.py``): each fused matmul whose source tensors are all
Q8_0, Q4_0 or Q4_1 gets ``QuantPanels`` beside its fp32 weight (the torch paths and
prefill keep using that one). A decode step then reads ~1.1 bytes a weight instead of
4 (Q4_1 values are read as int8: a second step would keep them as nibbles)."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.kernels.quant_panels import QuantPanels, QuantRows

# fused matmul -> the checkpoint's tensors it holds, in row order
_LAYER_PARTS = {
    ("self_attn", "qkv"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn", "o"): ("self_attn.o_proj",),
    ("mlp", "gate_up"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "down"): ("mlp.down_proj",),
}


def attach(model, model_dir: str | Path) -> int:
    """Give ``model``'s fused matmuls their quantized panels where the model is a GGUF
    file whose tensors allow it; returns how many got them."""
    from pdserve.engine.gguf_file import GGUFModel, find_gguf

    path = find_gguf(model_dir)
    if path is None:
        return 0
    gguf = GGUFModel.open(path)
    done = 0
    for i, layer in enumerate(model.model.layers):
        for (part, name), sources in _LAYER_PARTS.items():
            names = [f"model.layers.{i}.{s}.weight" for s in sources]
            done += _give(getattr(getattr(layer, part), name), gguf, names)
    head = "model.embed_tokens.weight" if model.cfg.tie_word_embeddings else "lm_head.weight"
    done += _give(model.logits_proj, gguf, [head])
    return done


def _give(matmul, gguf, names: list[str]) -> int:
    if matmul.panels is None or not all(gguf.has_tensor(n) for n in names):
        return 0  # no fp32 panels: the C kernels do not run this matmul
    found = [gguf.quantized(n) for n in names]
    if any(f is None for f in found):
        return 0
    rows = QuantRows.cat([QuantRows(torch.from_numpy(v), torch.from_numpy(s),
                                    None if o is None else torch.from_numpy(o), 32)
                          for v, s, o in found])
    if rows.shape != (matmul.out_features, matmul.in_features):
        return 0
    matmul.quant = QuantPanels.pack(rows)
    return 1
