"""Quantized matmul weights for the C kernels (``kernels/quant_panels.py``).

1. A GGUF file's quantized matmuls are kept as the file holds them: each fused matmul
   whose source tensors are all Q8_0, Q4_0, Q4_1, Q4_K or Q6_K gets ``QuantPanels`` (int8
   values, or nibbles where they fit, with a scale and offset per 32, per 16 for Q6_K).
   A product of any number of rows then reads 0.625 (Q4_0, Q4_1), 0.75 (Q4_K), 1.0625
   (Q8_0) or 1.25 (Q6_K) bytes a weight instead of 4, and the fp32 weight is dropped:
   the panels serve prompts too (``MatMul.forward``: faster than MKL's fp32 GEMM here),
   and a tied embedding reads the LM head's records (``QuantEmbedding``). A rank holds
   each weight once. ``keep_fp32`` (a compiled decode graph, which multiplies fp32
   weights) keeps the dequantized copy beside the panels.
2. With ``at_load="int8"`` every other matmul the C kernels run is quantized at load:
   symmetric, an fp16 scale per 32 weights of a row (16 where K is no multiple of 32;
   the largest magnitude maps to 127); with ``at_load="bf16"`` rounded to bf16 (2 bytes
   a weight, unit scales: exact for a bf16 checkpoint; every ISA converts a bf16 to
   fp32 with a shift, and the activations stay fp32); either way
   its fp32 weight dropped (kept as the dequantized one with ``keep_fp32``), so that
   every path (prefill, a moved request's replay, the decode step) computes with the
   same weights.
3. ``activations`` says what the panels multiply: "int8" rows of x quantized per block
   (``QuantPanels.pack(dots=True)``, ``kernels/dot_block.h``), "fp32" exact rows,
   "auto" int8 for the file's blocks but the attention's q|k|v (``int8_rows_for``),
   fp32 for weights quantized at load. bf16 values always meet fp32 rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn as nn

from pdserve.engine.model.gguf_file import GGUFModel, find_gguf
from pdserve.kernels import quant_panels
from pdserve.kernels.quant_panels import QuantPanels, QuantRows, dots_fit

log = logging.getLogger(__name__)

BLOCK_K = 32
# fused matmul -> the checkpoint's tensors it holds, in row order
_LAYER_PARTS = {
    ("self_attn", "qkv"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn", "o"): ("self_attn.o_proj",),
    ("mlp", "gate_up"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "down"): ("mlp.down_proj",),
}


def attach(model, model_dir: str | Path, at_load: str = "auto", keep_fp32: bool = False,
           activations: str = "auto") -> int:
    """Give ``model``'s fused matmuls their quantized panels (a GGUF file's blocks; with
    ``at_load`` "int8" or "bf16" the others quantized so at load); returns how many got
    them. Unless ``keep_fp32``, each drops its fp32 weight (the panels serve every
    product), and a tied embedding reads the LM head's panels."""
    path = find_gguf(model_dir)
    gguf = GGUFModel.open(path) if path is not None else None
    head = "model.embed_tokens.weight" if model.cfg.tie_word_embeddings else "lm_head.weight"
    targets = [(getattr(getattr(layer, part), name),
                [f"model.layers.{i}.{s}.weight" for s in sources])
               for i, layer in enumerate(model.model.layers)
               for (part, name), sources in _LAYER_PARTS.items()]
    targets.append((model.logits_proj, [head]))
    done = 0
    for matmul, names in targets:
        if matmul.panels is None:
            continue  # no fp32 panels: the C kernels do not run this matmul
        rows = _from_file(gguf, names) if gguf is not None else None
        quantize = _AT_LOAD.get(at_load) if rows is None and matmul.in_features % 16 == 0 \
            else None
        if quantize is not None:
            rows = quantize(matmul.weight.detach())
        if rows is None or rows.shape != (matmul.out_features, matmul.in_features):
            continue
        dots = dots_fit(rows) and int8_rows_for(activations, names[0], from_file=quantize is None)
        try:
            matmul.quant = QuantPanels.pack(rows, dots=dots)
        except ValueError as e:  # a weight that is not finite: this one stays fp32
            log.warning("matmul %s stays fp32: %s", names[0], e)
            continue
        if keep_fp32:
            if quantize is not None:  # every path computes with the same weights
                matmul.weight = nn.Parameter(rows.dequantize(), requires_grad=False)
            matmul.panels = None  # the quantized panels serve every product now
        else:
            matmul.drop_fp32()
        done += 1
    head = model.logits_proj
    if model.cfg.tie_word_embeddings and head.quant is not None and not keep_fp32:
        model.model.embed_tokens = QuantEmbedding(head.quant, head.kernel_isa)
    return done


class QuantEmbedding(nn.Module):
    """A tied model's embedding read from its LM head's quantized panels (rows
    dequantized on lookup, bit for bit the weight's rows), so that the matrix is held
    once, quantized (``attach``)."""

    def __init__(self, head: QuantPanels, kernel_isa: str | None = None):
        super().__init__()
        self.quant = head
        self.kernel_isa = kernel_isa  # skinny_gemm's build; None: the host's

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return quant_panels.gather_columns(self.quant, tokens, self.kernel_isa)


def int8_rows_for(activations: str, name: str, from_file: bool) -> bool:
    """Does the matmul holding checkpoint tensor ``name`` multiply int8 rows?
    "auto" says yes for a file's blocks except the attention's q|k|v: an error in q or
    k passes through the softmax's exponent. Measured on the real model's 16 chat
    questions, 48 greedy tokens each: 9 answers equal to fp32 activations' with every
    matmul on int8 rows, 14 with q|k|v on fp32 rows (which cost 0.15 of a 4 ms step);
    perplexity within 0.1% of fp32's either way (docs/models.md)."""
    if activations == "auto":
        return from_file and ".self_attn.q_proj." not in name
    return activations == "int8"


def _from_file(gguf, names: list[str]) -> QuantRows | None:
    if not all(gguf.has_tensor(n) for n in names):
        return None
    found = [gguf.quantized(n) for n in names]
    if any(f is None for f in found):
        return None
    return QuantRows.cat([QuantRows(torch.from_numpy(v), torch.from_numpy(s),
                                    None if o is None else torch.from_numpy(o), bk)
                          for v, s, o, bk in found])


def round_bf16(weight: torch.Tensor) -> QuantRows:
    """``weight`` [N, K] rounded to bf16 (to nearest even), with unit scales per block of
    up to 128 (the kernels' unit of K): a bf16 checkpoint's weights exactly."""
    n, k = weight.shape
    bk = next(b for b in (128, 64, 32, 16) if k % b == 0)
    return QuantRows(weight.to(torch.bfloat16).contiguous(), torch.ones(n, k // bk), None, bk)


def quantize_int8(weight: torch.Tensor) -> QuantRows:
    """``weight`` [N, K] as int8 with a scale per 32 of a row (per 16 where K is no
    multiple of 32; symmetric: the block's largest magnitude maps to 127 or just under,
    the scale being the next fp16 value up, as the records hold scales in fp16; an
    all-zero block gets scale 0)."""
    n, k = weight.shape
    bk = BLOCK_K if k % BLOCK_K == 0 else BLOCK_K // 2
    blocks = weight.float().reshape(n, k // bk, bk)
    amax = blocks.abs().amax(dim=-1)
    halves = (amax / 127.0).to(torch.float16)
    short = halves.float() * 127.0 < amax  # rounded down: the largest would pass 127
    halves = torch.where(short, torch.nextafter(halves, torch.full_like(halves, float("inf"))),
                         halves)
    # past fp16's range: fp32 scales (the records then hold fp32)
    scales = torch.where(torch.isfinite(halves), halves.float(), amax / 127.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(blocks / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantRows(values.reshape(n, k), scales.contiguous(), None, bk)


# "quantization" -> how a matmul the file holds no quantized blocks for is quantized at load
_AT_LOAD = {"int8": quantize_int8, "bf16": round_bf16}
