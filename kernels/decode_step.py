"""A whole decode step of a Llama-family model in one C call (CPU, fp32).

    step = DecodeStep(dims, layers, final_norm, embedding, lm_head_panels, vocab)  # per model
    stores = step.bind(k_stores, v_stores, ring_len)      # once per KV cache
    hidden, logits, tokens = step.run(tokens, positions, max_len, stores, cos, sin,
                                      block_tables, state_slots, logits=True, greedy=True)

Why: a decode step of the built-in models is ~100 small operations per layer; with torch
each is a dispatch (a few µs to tens of µs of Python and ATen) and every parallel matmul
wakes the OpenMP team (tens of µs under ``OMP_WAIT_POLICY=PASSIVE``). For the tiny model
those overheads were most of the step (compiled: 2.8 ms for ~25 MB of weights and K/V).
Here every layer's work runs in one OpenMP region whose phases meet at a spinning
barrier: the tokens' embedding rows and rmsnorm; q|k|v matmul; per row (Qwen3's q/k
norm,) rope, the K/V write and attention over the row's keys, read in place (no mask, no
gathered copy: each row's length is its own) from the paged cache through its block
table (keys ``[0, pos]``), or from its ring in a sliding-window layer (the last
``window`` positions); o matmul + residual; rmsnorm; gate|up matmul; SiLU * up; down
matmul + residual; then the final norm and, if asked, the LM head and each row's greedy
token. The step takes token ids, positions and block tables and hands back logits and
tokens: around the call a one-row step of the real model spent ~0.9 ms (of ~5.4) in
Python and torch calls, each slow because the step's ~96 MB of weights had swept the
caches (the embedding's row and the rope rows alone ~95 µs, the argmax ~70). Matmuls are
``skinny_block.h`` on ``skinny_gemm``'s column panels (fp32, or quantized records read
in place); each thread takes chunks of its own contiguous share of panels first, then
helps the others, so each output is computed whole by one thread and results do not
depend on the thread count. Attention (``decode_attention.h``) takes groups of rows from
a counter: a row, or a sequence's consecutive rows through one block table (a
speculative step's drafted positions, at most 8), which read each key and value once for
the whole group; in a step of at most 4 groups, parts of 128 positions merged after (the
cut depends only on the rows). Real model, 4 drafted rows at 1000 positions: the
attention phase 5.4 -> 3.7 ms a step; 6 rows: 9.2 -> 4.7 ms. Small model, 16 rows, 2
threads, AVX-512 build: 22-28 ms per step (torch eager ~41-48, compiled ~34-63), its
matmuls at ~17 GB/s of weights; AVX2 build 28-42 ms, bound by its FMAs
(``bench/decode_paths.py`` compares every path side by side; ``bench/offline.py
--analyse`` times each phase). One source for every ISA (``simd.h``), built by
``cbuild`` for the host's or the one asked for (``isa``).

Numerics follow transformers' fp32 models (same formulas, sums in a different order,
``exp`` to ~1 ulp): hidden states agree with the torch path to ~1e-5 and greedy tokens
equal transformers' (tests). Limits (checked by ``supported``): fp32 on the CPU,
hidden size and head size multiples of 16 and 32, head size at most 256, query heads a
multiple of the K/V heads.
"""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.kernels import cbuild, skinny_gemm
from pdserve.kernels.quant_panels import QuantPanels

# Phases of a layer, in decode_step.c's PH_* order ("norm" includes the final norm).
PHASES = ("norm", "qkv", "attention", "o_proj", "post_norm", "gate_up", "silu_mul", "down",
          "lm_head", "greedy")
# decode_step.c's dims (D_* order)
_DIMS = ("rows", "hidden", "q_heads", "kv_heads", "head_dim", "intermediate", "layers",
         "block_size", "num_blocks", "table_width", "max_len", "ring_len", "state_slots",
         "kv_half", "vocab")
# Pointer order of one layer (decode_step.c's P_* enum).
LAYER_FIELDS = ("ln", "qkv", "qkv_bias", "o", "o_bias", "ln2", "gate_up", "gate_up_bias",
                "down", "down_bias", "q_norm", "k_norm", "k_store", "v_store", "window")
_WEIGHT_FIELDS = LAYER_FIELDS[:12]
_MATMUL_FIELDS = ("qkv", "o", "gate_up", "down")
# A matmul's weight as decode_step.c's Weight struct: format, values, bk, bits, offsets,
# scale_bytes.
W_FP32, W_QUANT, W_DOTS = 0, 1, 2  # decode_step.c: fp32 panels; quantized, by fp32 or int8 rows
_DESCRIPTOR_INTS = 6


def _library(isa: str | None = None) -> ctypes.CDLL | None:
    return _built(cbuild.resolve_isa(isa))


@functools.cache
def _built(isa: str) -> ctypes.CDLL | None:
    if not skinny_gemm.available(isa):  # same requirements; one warning is enough
        return None
    lib = cbuild.load("decode_step", isa)
    if lib is not None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.decode_step_workspace.argtypes = [p, i64]
        lib.decode_step_workspace.restype = i64
        lib.decode_step.argtypes = [p, p, p, p, p, p, p, p, p, p, p, p, p, i64, p, p, p,
                                    ctypes.c_double, ctypes.c_double, ctypes.c_int, p]
        lib.decode_step.restype = ctypes.c_int
    return lib


def available(isa: str | None = None) -> bool:
    return _library(isa) is not None


@dataclass(frozen=True)
class StepDims:
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    eps: float
    scale: float

    def supported(self) -> bool:
        return (self.hidden % 16 == 0 and self.head_dim % 32 == 0 and self.head_dim <= 256
                and self.q_heads % self.kv_heads == 0)


Weight = torch.Tensor | QuantPanels


@dataclass
class LayerWeights:
    """One layer's tensors (fp32, CPU, contiguous): norms' weights, and matmuls as
    ``skinny_gemm.pack`` panels or ``QuantPanels`` (int8 values dequantized in
    registers); biases may be None."""

    ln: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: Weight  # gate's rows, then up's
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # per-head RMSNorm weights (Qwen3), or None
    k_norm: torch.Tensor | None = None


_STORE_DTYPES = (torch.float32, torch.float16)  # a K/V store: fp32, or a 16-bit cache


def _ptr(t: torch.Tensor | None, dtypes: tuple = (torch.float32,)) -> int:
    if t is None:
        return 0
    if t.dtype not in dtypes or t.device.type != "cpu" or not t.is_contiguous():
        names = " or ".join({torch.float32: "fp32", torch.float16: "fp16"}[d] for d in dtypes)
        raise ValueError(f"decode_step needs contiguous {names} CPU tensors, got {t.dtype} "
                         f"{t.device} contiguous={t.is_contiguous()}")
    return t.data_ptr()


def _descriptor(w: Weight) -> list[int]:
    """decode_step.c's Weight for fp32 panels or quantized ones."""
    if isinstance(w, QuantPanels):
        if w.records.dtype != torch.uint8 or not w.records.is_contiguous() or \
                w.bits not in (4, 8, 16):
            raise ValueError("quantized panels must be contiguous uint8 records of int8 "
                             "values, nibble pairs or bf16 values")
        return [W_DOTS if w.dots else W_QUANT, w.records.data_ptr(), w.block_k, w.bits,
                int(w.has_offsets), w.scale_bytes]
    return [W_FP32, _ptr(w), 0, 0, 0, 0]


@dataclass(frozen=True)
class Stores:
    """A KV cache's stores as a step reads them (``DecodeStep.bind``): the per-layer
    pointer table and the stores' shapes. A cache's stores are allocated once, so a
    binding serves every step over it."""

    pointers: torch.Tensor  # [layers, 15] int64: weights, K store, V store, window
    num_blocks: int
    block_size: int
    ring_len: int
    state_slots: int
    half: bool  # fp16 stores (a 16-bit cache), else fp32
    paged: bool  # some layer attends over paged blocks
    ringed: bool  # some layer attends over its rings (sliding window)
    held: tuple  # the stores themselves: their memory lives while the binding does


class DecodeOutput(NamedTuple):
    hidden: torch.Tensor  # [n, hidden], after the final norm
    logits: torch.Tensor | None  # [n, vocab] fp32, when asked
    greedy: torch.Tensor | None  # [n] int64: each row's argmax, when asked


class DecodeStep:
    def __init__(self, dims: StepDims, layers: list[LayerWeights], final_norm: torch.Tensor,
                 embedding: Weight, lm_head: Weight | None = None, vocab_size: int = 0,
                 windows: tuple[int | None, ...] | None = None, isa: str | None = None):
        """``embedding``: the token embedding, fp32 rows [vocab, hidden] or quantized panels
        whose columns are the rows (a tied LM head's). ``lm_head``: the LM head's panels
        (``skinny_gemm.pack``, or ``QuantPanels``) for ``vocab_size`` outputs, so that
        ``run(..., logits=True)`` ends with the logits. ``windows``: each layer's sliding
        window (None: full attention, the default). ``isa``: which build runs it
        (default: the host's, ``cbuild.host_isa``)."""
        self.isa = cbuild.resolve_isa(isa)
        if _library(self.isa) is None:
            raise RuntimeError(f"decode_step ({self.isa}) is not available on this machine")
        if not dims.supported():
            raise ValueError(f"decode_step does not support {dims}")
        self.dims, self.layers, self.final_norm = dims, layers, final_norm
        self.windows = tuple(windows) if windows is not None else (None,) * len(layers)
        if len(self.windows) != len(layers) or any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"windows must give a window >= 1 or None per layer, got {windows}")
        if isinstance(embedding, QuantPanels):
            self.embedding_rows = embedding.out_features
            if embedding.in_features != dims.hidden:
                raise ValueError(f"embedding panels hold rows of {embedding.in_features}, "
                                 f"not the hidden size {dims.hidden}")
        else:
            self.embedding_rows = embedding.shape[0]
            if embedding.dim() != 2 or embedding.shape[1] != dims.hidden:
                raise ValueError(f"embedding must be [vocab, {dims.hidden}], got "
                                 f"{tuple(embedding.shape)}")
        self.embedding, self.lm_head, self.vocab_size = embedding, lm_head, vocab_size
        # one Weight struct (6 int64) per matmul, then the LM head's, then the embedding's;
        # layers point into it
        mats = [getattr(w, f) for w in layers for f in _MATMUL_FIELDS]
        self._descriptors = torch.tensor(
            [_descriptor(m) for m in mats]
            + [_descriptor(lm_head) if lm_head is not None else [0] * _DESCRIPTOR_INTS]
            + [_descriptor(embedding)], dtype=torch.int64)
        base, size = self._descriptors.data_ptr(), _DESCRIPTOR_INTS * 8
        where = {(i, f): base + (i * len(_MATMUL_FIELDS) + j) * size
                 for i in range(len(layers)) for j, f in enumerate(_MATMUL_FIELDS)}
        self._lm_head_descriptor = base + len(mats) * size if lm_head is not None else None
        self._embedding_descriptor = base + (len(mats) + 1) * size
        self._weights = [[where[i, f] if f in _MATMUL_FIELDS else _ptr(getattr(w, f))
                          for f in _WEIGHT_FIELDS] for i, w in enumerate(layers)]
        self._dims = torch.zeros(len(_DIMS), dtype=torch.int64)
        self._dims_view = self._dims.numpy()  # written per step without a torch call
        self._no_table = torch.zeros(1, 1, dtype=torch.int64)  # for steps without paged layers
        self._work = torch.empty(0)
        self._h = torch.empty(0, dims.hidden)
        self._times: torch.Tensor | None = None  # float64 [2, phases] while profiling
        self._profiled_steps = 0
        # The last step's C call alone, without the Python around it (bench/decode_paths)
        self.last_call_s = 0.0

    def start_profile(self) -> None:
        """Time each phase of the following steps (thread 0: work, then barrier wait)."""
        self._times = torch.zeros(2, len(PHASES), dtype=torch.float64)
        self._profiled_steps = 0

    def stop_profile(self) -> dict:
        """Mean ms per step of each phase since ``start_profile``: ``work`` (thread 0's
        share of the phase) and ``wait`` (its wait for the other threads)."""
        times, n = self._times, max(self._profiled_steps, 1)
        self._times = None
        if times is None:
            return {}
        return {kind: {ph: round(float(times[i, j]) / n / 1e6, 3) for j, ph in enumerate(PHASES)}
                for i, kind in enumerate(("work", "wait"))} | {"steps": self._profiled_steps}

    def bind(self, k_stores: list, v_stores: list, ring_len: int = 0) -> Stores:
        """What ``run`` reads of a KV cache: per layer, its K and V store: paged blocks
        [num_blocks, block_size, Hk, D], or rings [state_slots * ring_len, Hk, D] in a
        sliding-window layer. Stores are fp32, or all fp16 (a 16-bit cache,
        ``kv_precision``): a step writes its keys and values rounded to nearest even, as
        torch's ``.half()``, and widens what it reads."""
        stores = (*k_stores, *v_stores)
        if len({t.dtype for t in stores}) != 1:
            raise ValueError("every K/V store must have the same dtype (fp32 or fp16)")
        paged = [k for k, w in zip(k_stores, self.windows, strict=True) if w is None]
        ringed = [k for k, w in zip(k_stores, self.windows, strict=True) if w is not None]
        if ringed and (ring_len < max(w for w in self.windows if w is not None)
                       or ringed[0].shape[0] % ring_len):
            raise ValueError(f"ring_len {ring_len} does not fit the rings {ringed[0].shape} "
                             f"and windows {self.windows}")
        rows = [w + [_ptr(k, _STORE_DTYPES), _ptr(v, _STORE_DTYPES), win or 0]
                for w, k, v, win in zip(self._weights, k_stores, v_stores, self.windows, strict=True)]
        num_blocks, block_size = paged[0].shape[:2] if paged else (0, 1)
        return Stores(pointers=torch.tensor(rows, dtype=torch.int64), num_blocks=num_blocks,
                      block_size=block_size, ring_len=max(ring_len, 1),
                      state_slots=ringed[0].shape[0] // ring_len if ringed else 0,
                      half=k_stores[0].dtype == torch.float16, paged=bool(paged),
                      ringed=bool(ringed), held=stores)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int, stores: Stores,
            cos: torch.Tensor, sin: torch.Tensor, block_tables: torch.Tensor | None = None,
            state_slots: torch.Tensor | None = None, logits: bool = False,
            greedy: bool = False) -> DecodeOutput:
        """tokens [n] (int64) at positions [n] (each below ``max_len``) -> final-normed
        hidden [n, hidden]; with ``logits`` the logits [n, vocab] (fp32) too, and with
        ``greedy`` each row's argmax of them [n] (torch.argmax's answer).

        cos/sin: the rope tables [>= max_len, head_dim] (sin signed, ``RopeTable.tables``),
        looked up at each row's position. Full-attention layers attend to keys ``[0,
        position]`` through ``block_tables`` [n, width] (each row's blocks), sliding-window
        layers to the last ``window`` positions in the ring of each row's ``state_slots``
        entry; ``stores`` (``bind``) says where those live."""
        d = self.dims
        n = tokens.shape[0]
        threads = torch.get_num_threads()
        tables = block_tables if stores.paged else self._no_table
        states = state_slots if stores.ringed else positions  # unread without rings
        self._check(tokens, positions, tables, states, cos, sin, max_len, logits or greedy)
        self._dims_view[:] = (n, d.hidden, d.q_heads, d.kv_heads, d.head_dim, d.intermediate,
                              d.layers, stores.block_size, stores.num_blocks, tables.shape[1],
                              max_len, stores.ring_len, stores.state_slots, int(stores.half),
                              self.embedding_rows)
        lib = _library(self.isa)
        need = lib.decode_step_workspace(self._dims.data_ptr(), threads)
        if self._work.numel() < need:
            # zeros: padding rows are read (results dropped); a quarter more, since the
            # need grows with max_len, a position a step: reallocated and zeroed every
            # other step, it cost a one-row decode step 1-2%
            self._work = torch.zeros(need + need // 4)
        if self._h.shape[0] < n:  # the residual stream: scratch, kept between steps
            self._h = torch.empty(n, d.hidden)
        out = torch.empty(n, d.hidden)
        scores = torch.empty(n, self.vocab_size) if logits or greedy else None
        argmax = torch.empty(n, dtype=torch.int64) if greedy else None
        start = time.perf_counter()
        rc = lib.decode_step(
            self._dims.data_ptr(), stores.pointers.data_ptr(), tokens.data_ptr(),
            self._embedding_descriptor, self._h.data_ptr(), _ptr(cos), _ptr(sin), tables.data_ptr(),
            states.data_ptr(), positions.data_ptr(), _ptr(self.final_norm), out.data_ptr(),
            self._lm_head_descriptor if scores is not None else None, self.vocab_size,
            None if scores is None else scores.data_ptr(),
            None if argmax is None else argmax.data_ptr(), self._work.data_ptr(), d.eps,
            d.scale, threads, None if self._times is None else self._times.data_ptr())
        self.last_call_s = time.perf_counter() - start
        if rc == -1:
            raise MemoryError("decode_step could not allocate its work counters")
        if rc <= -2:
            r = -2 - rc
            where = [f"token {int(tokens[r])} (vocab {self.embedding_rows})",
                     f"position {int(positions[r])} (max_len {max_len})"]
            if stores.paged:
                where.append(f"block table {tables[r].tolist()} ({stores.num_blocks} blocks "
                             f"of {stores.block_size})")
            if stores.ringed:
                where.append(f"state slot {int(states[r])} ({stores.state_slots} slots)")
            raise IndexError(f"decode_step: row {r} reads outside the embedding or the "
                             f"cache: {', '.join(where)}; nothing was written")
        if self._times is not None:
            self._profiled_steps += 1
        return DecodeOutput(out, scores if logits else None, argmax)

    def _check(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
               states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, max_len: int,
               head: bool) -> None:
        """Refuse inputs the C step would misread (their values are checked there)."""
        for name, t in (("tokens", tokens), ("positions", positions), ("block tables", tables),
                        ("state slots", states)):
            if t is None:  # the stores hold paged layers (tables), or rings (state slots)
                raise ValueError(f"{name} are needed for the stores this step reads")
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous int64, got {t.dtype}")
        for t in (cos, sin):
            if t.shape[0] < max_len or t.shape[1] != self.dims.head_dim:
                raise ValueError(f"rope tables must be [>= {max_len}, {self.dims.head_dim}], "
                                 f"got {tuple(t.shape)}")
        if head and self.lm_head is None:
            raise ValueError("this DecodeStep was built without an LM head")
