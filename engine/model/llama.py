"""A Llama-family decoder, top to bottom, running on the paged KV cache.

Module names match Hugging Face checkpoints (``model.layers.3.self_attn.q_proj``),
so weights load by name; ``CausalLM.fuse`` then swaps each layer's projections for
fused matmuls (q|k|v, gate|up) with decode-friendly weight layouts (see ``MatMul``).
Decode-only steps may run elsewhere: as one C call (``engine/decode_kernel``) or through
compiled blocks (``engine/compiled_decode``); this file is the reference they are tested
against.
Input is a step's flat token list (rows back to back) with absolute positions;
attention metadata says where each row's keys live.

    h = embed(tokens)
    for each layer:
        x = rmsnorm(h); q, k, v = split(x @ Wqkv); (qwen3: q, k = rmsnorm per head)
        q, k = rope(q, k, positions); h += o_proj(attention(q, k, v, cache, meta))
        g, u = split(rmsnorm(h) @ Wgate_up); h += (silu(g) * u) @ Wdown
    logits = lm_head(rmsnorm(h))       # only at rows that sample
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.backends.base import ReferenceAttention
from pdserve.engine.model import decode_kernel, quantized_weights
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.quantized_weights import QuantEmbedding
from pdserve.engine.model.weights import WeightsError, load_checked
from pdserve.kernels import quant_panels, skinny_gemm
from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.huge_pages import Arena
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.norms import RMSNorm
from pdserve.kernels.rope import RopeTable, inv_frequencies


def _onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


class MatMul(nn.Module):
    """``x @ W.T (+ b)`` for 2-D ``x`` [T, in]; ``fuse`` concatenates projections that
    read the same input (q|k|v, gate|up), so a layer runs 4 matmuls instead of 7.

    On CPU in fp32 the weight is also kept in a second layout for inputs of at most
    ``DECODE_MAX_ROWS`` rows (decode steps), the first that applies:

    - column panels for ``kernels/skinny_gemm`` (``out`` a multiple of 32; built for the
      CPU's ISA, or ``kernel_isa``'s, see ``CausalLM.use_kernel_isa``):
      a kernel built for a few rows times a large weight that streams the weights at
      the memory bandwidth (small model, 16 rows, 2 threads: 15 ms vs 24 ms for the
      best torch layout below);
    - up to ``TRANSPOSED_MAX_NUMEL`` elements: ``W.T`` contiguous, multiplied by
      ``torch.mm``. MKL's small-``M`` kernels run ~1.5x faster on a [in, out] operand
      than on the transposed view ``F.linear`` passes (tiny model, all decode matmuls,
      16 rows: 1.34-1.49 ms vs 1.90-2.54 ms; 1 and 2 threads);
    - larger: oneDNN's packed (blocked) layout; with a plain weight MKL re-packs it on
      every call. Small model, all decode matmuls, 16 rows: packed 44.5 ms vs 58.4 ms
      ``F.linear`` (1 thread), 27.4 vs 31.9 ms (2 threads). ``torch.compile`` cannot
      take a packed weight, so ``use_transposed`` switches to ``W.T`` for compiled graphs.

    At prefill shapes (2048 rows) ``F.linear`` on the plain weight is the fastest
    (small model, 2 threads: 1.53 s vs 1.72 s for ``W.T``), hence two copies: the
    weights take twice their size in memory on this path. The layout is a fixed rule
    (not timed at start-up) so that processes on like machines (same CPU features and
    compiler) compute bitwise the same logits, e.g. a replacement rank replaying a
    greedy request.
    Elsewhere (GPU, bf16/fp16): ``F.linear`` only.

    A matmul given quantized panels (``quant``, engine/model/quantized_weights.py) multiplies
    them for every product, whatever its rows, and usually drops the fp32 weight
    (``drop_fp32``).
    """

    PACK_BATCH_HINT = 16  # oneDNN picks its blocking for about this many rows
    DECODE_MAX_ROWS = 128
    TRANSPOSED_MAX_NUMEL = 1_500_000

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.panels = self.packed = self.transposed = None
        # the weight as a GGUF file's blocks hold it, for the C decode step
        # (engine/model/quantized_weights.py); None: it reads the fp32 panels
        self.quant = None
        self.kernel_isa: str | None = None  # skinny_gemm's build; None: the host's
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            if self.out_features % 32 == 0 and skinny_gemm.available():
                self.panels = skinny_gemm.pack(weight)
            elif weight.numel() <= self.TRANSPOSED_MAX_NUMEL or not _onednn_packing_available():
                self.use_transposed()
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_BATCH_HINT)

    def use_transposed(self) -> None:
        """Decode rows multiply ``W.T`` (contiguous) instead of a packed weight."""
        self.transposed = self.weight.detach().t().contiguous()
        self.packed = None

    def decode_operand(self) -> torch.Tensor:
        """What a compiled graph passes to ``linear`` below for decode rows: the panels,
        a [out, in] view of the contiguous ``W.T``, or the plain weight."""
        if self.panels is not None:
            return self.panels
        return self.transposed.t() if self.transposed is not None else self.weight

    @classmethod
    def fuse(cls, linears: list[nn.Linear]) -> MatMul:
        w = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
        if all(m.bias is None for m in linears):
            return cls(w, None)
        b = torch.cat([m.bias if m.bias is not None else w.new_zeros(m.out_features)
                       for m in linears])
        return cls(w, b)

    def weight_bytes(self) -> int:
        """Bytes one decode multiplication reads (one copy of the weight: its quantized
        panels where it has them)."""
        if self.quant is not None:
            return self.quant.nbytes()
        return self.out_features * self.in_features * self.weight.element_size()

    def swept(self) -> torch.Tensor | None:
        """What the C decode step reads of this matmul: its quantized records, else its
        fp32 panels (None: it reads neither)."""
        return self.quant.records if self.quant is not None else self.panels

    def move_swept(self, arena: Arena) -> None:
        """Hold ``swept()`` in ``arena`` from now on (the old copy is dropped)."""
        if self.quant is not None:
            self.quant = dataclasses.replace(self.quant, records=arena.take(self.quant.records))
        elif self.panels is not None:
            self.panels = arena.take(self.panels)

    def drop_fp32(self) -> None:
        """Keep only the quantized panels (``quant``), which then serve every product:
        the weight is held once, at its quantized size."""
        if self.quant is None:
            raise ValueError("a matmul without quantized panels keeps its fp32 weight")
        self.weight = None
        self.panels = self.packed = self.transposed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:  # any rows: 1.7-2.3x faster than F.linear (docs/models.md)
            return quant_panels.matmul(x, self.quant, self.bias, self.kernel_isa)
        if x.shape[0] <= self.DECODE_MAX_ROWS:
            if self.panels is not None:
                return skinny_gemm.matmul(x, self.panels, self.out_features, self.bias,
                                          self.kernel_isa)
            if self.transposed is not None:
                if self.bias is None:
                    return torch.mm(x, self.transposed)
                return torch.addmm(self.bias, x, self.transposed)
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, operand: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a ``MatMul.decode_operand``: panels ([P, K, 16], P * 16
    outputs) or a [out, in] weight (view)."""
    if operand.dim() == 3:
        return torch.ops.pdserve.skinny_matmul(x, operand, operand.shape[0] * 16, bias)
    return F.linear(x, operand, bias)


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

    def forward(self, x, rotation, cache: KVCache, meta, backend,
                keep: torch.Tensor | None = None):
        """``keep``: flat token indices whose output is wanted (the cache is written for
        every token); None: all."""
        t, hq, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x).view(t, hq + 2 * hk, d)
        v = qkv[:, hq + hk:]
        rope = backend.ops.rope
        if self.qk_norm:
            q, k = self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq:hq + hk])
            q, k = rope(q, rotation), rope(k, rotation)
        else:  # one rotation for the q and k heads together (same cos/sin per token)
            qk = rope(qkv[:, :hq + hk], rotation)
            q, k = qk[:, :hq], qk[:, hq:]
        out = backend.forward(self.layer, q, k, v, cache, meta, self.scale)
        if keep is not None:
            out = out.index_select(0, keep)
        return self.o(out.reshape(out.shape[0], hq * d))


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

    def forward(self, x, ops):
        return self.down(ops.silu_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, residual, rotation, cache, meta, backend,
                keep: torch.Tensor | None = None):
        """(this layer's MLP output, the residual stream before it): the next norm adds
        the two (``LayerOps.norm``), so an add and a norm are one op where the backend
        fuses them. ``residual`` None: ``h`` is the embedding. ``keep``: compute the
        output only at these flat token indices (every token's K/V is still written);
        the result then has ``len(keep)`` rows."""
        ops = backend.ops
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        x, residual = ops.norm(h, ln1.weight, ln1.eps, residual)
        a = self.self_attn(x, rotation, cache, meta, backend, keep)
        if keep is not None:
            residual = residual.index_select(0, keep)
        x, residual = ops.norm(a, ln2.weight, ln2.eps, residual)
        return self.mlp(x, ops), residual


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
        self.kernel_isa: str | None = None  # the C kernels' build (use_kernel_isa); None: the host's
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RopeTable | None = None  # set by init_rope (not a weight)
        # where attention and the small ops run (engine/backends); the runner sets it
        self.backend = ReferenceAttention()

    def use_backend(self, backend) -> None:
        """Run attention and the layer ops through ``backend`` (engine/backends/base.py)."""
        self.backend = backend

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
        """After loading by checkpoint names: fused matmul weights with their decode
        layouts (see ``MatMul``); the unfused originals are dropped."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.logits_proj = MatMul.fuse([self.lm_head])
        del self.lm_head

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [T] -> final hidden states [T, hidden] (after the last norm).

        ``keep``: the flat token indices whose hidden state is wanted (those that
        sample); the result is then [len(keep), hidden]. Every layer still writes K/V
        for all T tokens, but the last layer's o_proj and MLP run on the kept rows only:
        in a prefill step that is most of one layer's matmuls saved (a 2048-token
        prefill keeps 16)."""
        backend = self.backend
        h = self.model.embed_tokens(tokens)
        rotation = backend.ops.rotation(self.rope, positions, h.dtype, meta.max_position)
        last = len(self.model.layers) - 1
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, rotation, cache, meta, backend,
                                keep if i == last else None)
        norm = self.model.norm
        return backend.ops.norm(h, norm.weight, norm.eps, residual)[0]

    def use_compiled(self, compiled) -> None:
        """Decode steps through compiled dense blocks where they qualify: a
        ``CompiledDecode`` built for this model (engine/model/compiled_decode.py)."""
        self._compiled = compiled

    def use_kernel_isa(self, isa: str | None) -> None:
        """Which build of the C kernels (``kernels/cbuild.ISAS``) the eager matmuls and
        the decode step (``use_decode_kernel``, called after this) run; None: the host's.
        The compiled blocks' matmuls keep the host's build."""
        self.kernel_isa = isa
        for m in self.modules():
            if isinstance(m, (MatMul, QuantEmbedding)):
                m.kernel_isa = isa

    def use_decode_kernel(self, on: bool = True) -> bool:
        """Decode steps through ``kernels/decode_step`` (one C call per step) where it
        applies (see ``engine/decode_kernel``); returns whether it is now on."""
        self._kernel = decode_kernel.build(self, self.kernel_isa) if on else None
        return self._kernel is not None

    @property
    def decode_kernel_on(self) -> bool:
        """Do decode steps run as the C step (``use_decode_kernel``)?"""
        return getattr(self, "_kernel", None) is not None

    def forward_decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       meta: AttentionMetadata) -> torch.Tensor:
        """``forward`` for a decode-only step: through the C decode step when
        ``use_decode_kernel`` turned it on and the step qualifies, else through the
        compiled dense blocks when ``use_compiled`` gave them and the step qualifies, else
        eager."""
        k = getattr(self, "_kernel", None)
        if k is not None and k.supports(cache, meta):
            return k.run(tokens, positions, cache, meta).hidden
        c = getattr(self, "_compiled", None)
        if c is None or not c.supports(cache, meta):
            return self(tokens, positions, cache, meta)
        with torch.inference_mode():
            return c.run(tokens, positions, cache, meta)

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      meta: AttentionMetadata, greedy: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``compute_logits(forward_decode(...))``, with the LM head inside the C decode
        step where it runs the step (one call instead of two); and with ``greedy``, where
        the C step runs, each row's argmax of the logits from the same call (else None)."""
        k = getattr(self, "_kernel", None)
        if k is not None and k.has_logits and k.supports(cache, meta):
            out = k.run(tokens, positions, cache, meta, logits=True, greedy=greedy)
            return out.logits, out.greedy
        return self.compute_logits(self.forward_decode(tokens, positions, cache, meta)), None

    def gather_swept_weights(self) -> Arena | None:
        """Move what a decode step reads of every matmul into one allocation on 2 MiB
        pages (``kernels/huge_pages``: 0.96-0.97x the one-row step); a tied embedding keeps
        reading the LM head's panels. None when no matmul has any."""
        mats = [m for m in self.modules() if isinstance(m, MatMul) and m.swept() is not None]
        if not mats:
            return None
        arena = Arena(sum(Arena.footprint(m.swept()) for m in mats))
        for m in mats:  # one at a time: the load's peak grows by one tensor, not all
            m.move_swept(arena)
        if isinstance(self.model.embed_tokens, QuantEmbedding):
            self.model.embed_tokens.quant = self.logits_proj.quant
        return arena

    def matmul_quantized(self) -> bool:
        """Does any matmul compute with quantized panels?"""
        return any(m.quant is not None for m in self.modules() if isinstance(m, MatMul))

    def int8_activations(self) -> bool:
        """Does any matmul multiply int8 rows of x (``activation_precision``)?"""
        return any(m.quant is not None and m.quant.dots for m in self.modules()
                   if isinstance(m, MatMul))

    def matmul_weight_bytes(self) -> int:
        """Bytes of every matmul weight: what a decode step reads at least once."""
        return sum(m.weight_bytes() for m in self.modules() if isinstance(m, MatMul))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_proj(hidden).float()


def load_model(model_dir, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu",
               quantization: str = "auto", keep_fp32: bool = False,
               activations: str = "auto") -> tuple[ModelConfig, CausalLM]:
    """Build the model for ``model_dir``'s config.json and load its checked weights;
    ``quantization``: which matmuls are held quantized ("auto": a GGUF file's quantized
    ones; "int8" or "bf16": the others too, so at load; "none";
    engine/model/quantized_weights.py); ``keep_fp32``: they keep their fp32 weight too (what
    a compiled decode graph multiplies); ``activations``: what the quantized ones
    multiply by (EngineSettings.activation_precision)."""
    cfg = ModelConfig.from_model(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = model.expected_shapes()
    # A tied matrix is saved under either name (transformers' safetensors writer keeps
    # lm_head.weight); one of the two must be there.
    tied = ("model.embed_tokens.weight", "lm_head.weight")
    optional = frozenset(tied) if cfg.tie_word_embeddings else frozenset()
    state = load_checked(model_dir, expected, dtype, device, optional)
    if cfg.tie_word_embeddings:
        matrix = state.get(tied[0], state.get(tied[1]))
        if matrix is None:
            raise WeightsError(f"model {model_dir}: missing tensor(s) {tied[0]} (tied "
                               f"embeddings: {tied[0]} or {tied[1]})")
        state[tied[0]] = state[tied[1]] = matrix
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope(device)
    model.fuse()
    if quantization != "none":
        quantized_weights.attach(model, model_dir, at_load=quantization,
                                 keep_fp32=keep_fp32, activations=activations)
    model.gather_swept_weights()
    _return_freed_memory()
    return cfg, model.eval().requires_grad_(False)


def _return_freed_memory() -> None:
    """Give the load's transient copies (every tensor dequantized to fp32, then fused)
    back to the OS: glibc keeps freed heap memory otherwise, and a rank whose matmuls
    are quantized would stay at the fp32 model's size (the real model's runner with 64
    KV blocks: 1.09 GiB resident after loading, 0.31 GiB after this). A no-op without
    glibc."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass
