"""ModelRunner: the model, its paged KV cache and the sampler behind one call.

    runner = ModelRunner(model_dir, dtype="float32", device="cpu", block_size=16)
    tokens = runner.execute([RunnerRow(token_ids=[...], start_pos=0, block_table=[1, 2],
                                       state_slot=0, sampling=SamplingParams(...),
                                       sample=True, output_index=0), ...])

Decode steps run as one C call (``kernels/decode_step``) where the CPU and model allow
(``decode_kernel=True``, the default; ``runner.decode_kernel`` says whether it is on).
``compile=True``: decode steps the C call does not take run each layer's dense work
through ``torch.compile`` (``CausalLM.use_compiled``); the first pay the compile.

A row's ``token_ids`` are its ``q`` query tokens at positions
``start_pos .. start_pos + q - 1`` (``start_pos = seqlen_k - q``, spec S36); its
``block_table`` must cover ``seqlen_k`` positions; ``state_slot`` addresses the
sliding-window ring (ignored by models without one). A step may mix prefill chunks
of several requests and decode rows (q = 1). ``execute`` returns one sampled token
per row, or ``None`` for rows with ``sample=False`` (non-final prompt chunks);
``execute_with_logprobs`` also each token's logprobs where ``sampling.logprobs`` asks.
A row's ``controls`` (penalties, bias, min_tokens, bad words, a grammar's matcher:
``engine/logits_controls.py``) shape the logits it samples from; logprobs stay raw.
A row with ``extra_draws`` gets that many more tokens drawn from its logits (the first
tokens of its forks): they follow the rows' entries, in row order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace as dataclass_replace
from pathlib import Path

import torch

from pdserve.engine.backends import select_backend
from pdserve.engine.config import (
    DEFAULT_KV_CACHE_MB,
    DEFAULT_KV_COPY_THREADS,
    EngineConfig,
    engine_device,
    engine_dtype,
    kv_blocks_in,
    state_slots_for,
)
from pdserve.engine.logits_controls import apply_controls
from pdserve.engine.model.compiled_decode import CompiledDecode
from pdserve.engine.model.llama import load_model
from pdserve.engine.model.tokenizer import Tokenizer
from pdserve.engine.model.weights import file_digest, weight_files
from pdserve.engine.outputs import KVCapacity, TokenLogprobs
from pdserve.engine.step_inputs import RunnerRow
from pdserve.kernels import cbuild
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.sampling import greedy
from pdserve.kernels.sampling import sample as sample_tokens
from pdserve.scheduler.config import DEFAULT_BLOCK_SIZE

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``: the GPU where torch sees one (engine/config.py: engine_device)."""
    if isinstance(device, torch.device):
        return device
    return torch.device(engine_device(device, torch.cuda.is_available()))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """``auto``: bfloat16 on a GPU, float32 on the CPU (engine/config.py: engine_dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    dtype = engine_dtype(dtype, device.type if device is not None else "cpu")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose from {', '.join(_DTYPES)} or auto")
    return _DTYPES[dtype]


def kv_dtype(precision: str, model, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for ``EngineSettings.kv_precision``. On the CPU: ``fp32`` or
    ``fp16`` as asked; ``auto`` fp16 where the model's quantized matmuls multiply int8
    activations (a GGUF file's blocks: its author chose rounding, and llama.cpp's cache
    is f16 too), else the model's dtype. On a GPU the cache holds the model's dtype."""
    if device.type != "cpu":
        if precision != "auto":
            raise ValueError(f"kv_precision {precision!r} applies to CPU engines; on "
                             f"{device.type} the KV cache holds the model's dtype ({dtype})")
        return dtype
    if precision == "auto":
        return torch.float16 if model.int8_activations() else dtype
    return {"fp32": torch.float32, "fp16": torch.float16}[precision]


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_kv_blocks: int | None = None,
        num_state_slots: int | None = None,
        ring_len: int | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_MB << 20,
        seed: int = 0,
        adaptive_threads: bool = True,
        compile: bool = False,
        decode_kernel: bool = True,
        kernel_isa: str = "auto",
        kv_copy_threads: int = DEFAULT_KV_COPY_THREADS,
        quantization: str = "auto",
        activation_precision: str = "auto",
        kv_precision: str = "auto",
        backend: str = "auto",
        max_num_seqs: int = 64,
    ):
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        # a compiled graph multiplies fp32 weights: quantized matmuls keep theirs then
        self.config, self.model = load_model(model_dir, self.dtype, self.device,
                                             quantization=quantization, keep_fp32=compile,
                                             activations=activation_precision)
        self.compile = compile
        # ValueError now, naming what the CPU runs, for an ISA it cannot execute.
        self.kernel_isa = cbuild.resolve_isa(kernel_isa) if self.device.type == "cpu" else None
        self.model.use_kernel_isa(self.kernel_isa)
        # Decode steps: one C call where the CPU and model allow, else torch (compiled
        # dense blocks when asked), see CausalLM.forward_decode.
        self.model.use_decode_kernel(decode_kernel)
        if compile:
            self.model.use_compiled(CompiledDecode(self.model))
        cfg = self.config
        self.block_size = block_size
        if num_state_slots is None:
            num_state_slots = 256 if cfg.has_sliding_window else 0
        held = kv_dtype(kv_precision, self.model, self.dtype, self.device)
        probe = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, block_size,
                        cfg.layer_windows, max(num_state_slots, 1), ring_len, held,
                        "meta")
        if num_kv_blocks is None:
            ring_bytes = probe.ring_bytes() // max(probe.num_state_slots, 1) * num_state_slots
            per_block = probe.bytes_per_block() if probe.full_layers else 0
            num_kv_blocks = kv_blocks_in(kv_cache_bytes, per_block, ring_bytes)
        self.kv_cache = KVCache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_kv_blocks, block_size,
            cfg.layer_windows, num_state_slots, ring_len, held, self.device,
            copy_threads=kv_copy_threads, compute_dtype=self.dtype,
        )
        self.num_kv_blocks = num_kv_blocks
        self.num_state_slots = num_state_slots
        self.ring_len = self.kv_cache.ring_len
        self.backend = select_backend(backend, self.model, self.kv_cache, kv_cache_bytes,
                                      adaptive_threads, max_num_seqs)
        self._gen = torch.Generator().manual_seed(seed)
        # Seeds a greedy step would have drawn: taken before the next draw (one call then,
        # none in a greedy step, where a draw cost ~26-46 µs with the caches swept)
        self._owed_draws = 0
        self._fingerprint: str | None = None
        self._tokenizer = None

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> ModelRunner:
        """Build from an engine's settings; its state slots are the scheduler's
        (``state_slots_for``), its KV blocks the settings' (``kv_blocks_in``)."""
        if config.num_threads:
            torch.set_num_threads(int(config.num_threads))
        return cls(
            config.model_dir,
            dtype=config.dtype,
            device=config.device,
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            num_state_slots=state_slots_for(config.max_num_seqs),
            kv_cache_bytes=config.kv_cache_memory_mb << 20,
            compile=config.compile,
            decode_kernel=config.decode_kernel,
            kernel_isa=config.kernel_isa,
            kv_copy_threads=config.kv_copy_threads,
            quantization=config.quantization,
            activation_precision=config.activation_precision,
            kv_precision=config.kv_precision,
            max_num_seqs=config.max_num_seqs,
        )

    # ---- identity ------------------------------------------------------------
    @property
    def tokenizer(self):
        """The folder's tokenizer (``pdserve.engine.model.tokenizer.Tokenizer``), loaded on first use."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_model(self.model_dir)
        return self._tokenizer

    @property
    def decode_kernel(self) -> bool:
        """Do decode steps run as the C step? (Read from the model, so that ``prepare``
        never disagrees with ``CausalLM.forward_decode`` about who takes a step.)"""
        return self.model.decode_kernel_on

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def model_fingerprint(self) -> str:
        """sha256 over the canonical config and every weights file's digest."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(json.dumps(self.config.raw, sort_keys=True).encode())
            for f in weight_files(self.model_dir):
                if f.suffix != ".gguf":  # a GGUF file is its content, whatever its name
                    h.update(f.name.encode())
                h.update(file_digest(f).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    # ---- its KV cache, as the engine and the KV hand-off ask for it -----------
    @property
    def sliding_window(self) -> bool:
        """Some layers keep a ring per state slot instead of blocks (a sliding window):
        such a model streams no KV chunks ahead and drafts nothing."""
        return bool(self.kv_cache.ring_layers)

    def kv_capacity(self, max_model_len: int) -> KVCapacity:
        """What the cache holds, and the bounds a rank's router checks requests against."""
        cache = self.kv_cache
        tokens = min(int(max_model_len), cache.num_blocks * cache.block_size)
        blocks = -(-tokens // cache.block_size)
        ring = cache.ring_bytes() // max(1, cache.num_state_slots)
        per_block = cache.bytes_per_block()
        return KVCapacity(block_size=cache.block_size, num_blocks=cache.num_blocks,
                          bytes_per_block=per_block,
                          total_bytes=cache.num_blocks * per_block + cache.ring_bytes(),
                          max_tokens=tokens, max_payload_bytes=blocks * per_block + ring,
                          device=str(cache.device),
                          dtype=str(cache.dtype).removeprefix("torch."))

    def copy_kv(self, blocks: list[tuple[int, int]], slots: list[tuple[int, int]]) -> None:
        """Forks' copy-on-write before a step writes: (source, copy) blocks, then slots."""
        for src, dst in blocks:
            self.kv_cache.copy_block(src, dst)
        for src, dst in slots:
            self.kv_cache.copy_state(src, dst)

    def check_kv_import(self, tensors: dict, num_prompt_tokens: int, skipped_blocks: int) -> None:
        """ValueError unless a payload's tensors fit this cache (names, shapes, dtype)."""
        self.kv_cache.check_import(tensors, num_prompt_tokens, skipped_blocks)

    def import_kv(self, block_ids: list[int], state_slot: int, tensors: dict) -> None:
        """A checked payload's KV into ``block_ids`` (and its rings into ``state_slot``)."""
        self.kv_cache.import_sequence(block_ids, state_slot, tensors)

    def write_kv_blocks(self, block_ids: list[int], k_blocks, v_blocks) -> None:
        """Streamed chunks' full blocks into ``block_ids``."""
        self.kv_cache.write_blocks(block_ids, k_blocks, v_blocks)

    def export_shapes(self, num_tokens: int, first_block: int = 0):
        """The tensors a payload of ``num_tokens`` tokens carries (from ``first_block``)."""
        return self.kv_cache.export_shapes(num_tokens, first_block)

    def export_into(self, block_table: list[int], state_slot: int, num_tokens: int,
                    views: dict, first_block: int = 0) -> None:
        """Gather a sequence's KV straight into a payload's tensor ``views``."""
        self.kv_cache.export_into(block_table, state_slot, num_tokens, views, first_block)

    # ---- one step ------------------------------------------------------------
    def execute(self, rows: list[RunnerRow]) -> list[int | None]:
        return self.execute_with_logprobs(rows)[0]

    def execute_with_logprobs(
            self, rows: list[RunnerRow]) -> tuple[list[int | None], list[TokenLogprobs | None] | None]:
        """``execute``, and each row's ``TokenLogprobs`` (None for a row that samples
        nothing or whose ``sampling.logprobs`` is None); the list is None when no row of
        the step asked (nothing was computed).

        Raw logprobs (vLLM's default): ``log_softmax`` in fp32 of the model's logits at
        the row's last position, the very logits its token was drawn from, before
        temperature, top-k and top-p. So a sampled token's value is its probability under
        the model, not under the filtered distribution it was drawn from (a token top-k
        / top-p would have refused cannot be drawn, so it never shows as the chosen one;
        it may still be among the alternatives). Every step path hands its logits here
        (the C decode step, ``decode_logits``, returns them too; ``greedy`` reads them), so
        the values do not depend on which path ran. Cost: only rows that asked pay, one
        ``log_softmax`` over the vocabulary and one ``topk`` (k = the largest asked in
        the step) for those rows together; a step where none asked does nothing more
        than scan its rows' settings."""
        if not rows:
            return [], None
        want = [i for i, r in enumerate(rows) if r.sample]
        extra = [(j, sp) for j, i in enumerate(want) for sp in rows[i].extra_draws]
        out: list[int | None] = [None] * (len(rows) + len(extra))
        wanted = [rows[i] for i in want]
        with self.backend.step_scope(rows):
            # each row's token is its argmax: the step may take it while the logits are hot
            plain = bool(want) and not extra and all(
                r.sampling.temperature == 0 and r.controls is None for r in wanted)
            logits, argmax = self.backend.run(self.model, rows, want, plain)
            if not want:
                return out, None
            if extra:  # a fork's draw: its parent row's logits under the fork's settings
                logits = logits.index_select(0, torch.tensor(
                    [*range(len(want)), *(j for j, _ in extra)], device=logits.device))
                wanted += [dataclass_replace(wanted[j], sampling=sp, extra_draws=())
                           for j, sp in extra]
            if argmax is not None:
                self._owe_draws(len(wanted))  # as _sample's greedy path
                sampled = argmax
            else:
                controlled = apply_controls(logits, [r.sampling for r in wanted],
                                            [r.controls for r in wanted])
                sampled = self._sample(controlled, wanted)
            ask = [j for j, r in enumerate(wanted) if r.sampling.logprobs is not None]
            logprobs = self._logprobs(logits, sampled, wanted, ask) if ask else None
            tokens = sampled.tolist()
        slots = [*want, *range(len(rows), len(out))]  # where each drawn token goes
        for i, t in zip(slots, tokens, strict=True):
            out[i] = int(t)
        if logprobs is None:
            return out, None
        per_row: list[TokenLogprobs | None] = [None] * len(out)
        for j, lp in zip(ask, logprobs, strict=True):
            per_row[slots[j]] = lp
        return out, per_row

    @staticmethod
    def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, rows: list[RunnerRow],
                  ask: list[int]) -> list[TokenLogprobs]:
        """TokenLogprobs of ``rows[j]`` for each j in ``ask``; ``logits`` [len(rows), V]
        and ``sampled`` [len(rows)] are those rows' logits and drawn tokens."""
        if len(ask) < len(rows):
            idx = torch.tensor(ask, device=logits.device)
            logits, sampled = logits.index_select(0, idx), sampled.index_select(0, idx)
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, sampled.view(-1, 1).long()).view(-1).tolist()
        ks = [rows[j].sampling.logprobs for j in ask]
        kmax = min(max(ks), lp.shape[-1])
        if kmax > 0:
            top_vals, top_ids = lp.topk(kmax, dim=-1)  # sorted: most likely first
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        else:
            top_vals = top_ids = [[]] * len(ask)
        return [TokenLogprobs(c, ids[:k], vals[:k])
                for c, ids, vals, k in zip(chosen, top_ids, top_vals, ks, strict=True)]

    def compute_logits(self, rows: list[RunnerRow]) -> torch.Tensor:
        """Run the step (writing KV like ``execute``) and return fp32 logits [B, V] at
        each row's last query position, whatever its ``sample`` flag."""
        with self.backend.step_scope(rows):
            return self.backend.run(self.model, rows, list(range(len(rows)))).values

    # ---- internals -------------------------------------------------------------

    def prepare(self, rows: list[RunnerRow]):
        """Flat tokens/positions, attention metadata and each row's last token index
        for a step (on the device), as the backend builds them."""
        return self.backend.prepare(rows)

    def _owe_draws(self, n: int) -> None:
        self._owed_draws += n
        if self._owed_draws >= _MAX_OWED_DRAWS:  # a long greedy run: settle in bounded calls
            self._fresh_seeds(0)

    def _fresh_seeds(self, n: int) -> torch.Tensor:
        """n seeds from the generator, after those owed by greedy steps: the same values
        as drawing each step's seeds in turn (CPU draws are sequential)."""
        owed, self._owed_draws = self._owed_draws, 0
        return torch.randint(-(2**62), 2**62, (owed + n,), generator=self._gen)[owed:]

    def _sample(self, logits: torch.Tensor, rows: list[RunnerRow]) -> torch.Tensor:
        sp = [r.sampling for r in rows]
        if all(p.temperature == 0 for p in sp):
            # All greedy: argmax is the whole answer; skip building five per-row
            # settings tensors. The generator still owes the draws of the general path,
            # so later unseeded draws do not depend on which path ran.
            self._owe_draws(len(rows))
            return greedy(logits)
        n = len(rows)
        fresh = self._fresh_seeds(n)
        seeds = torch.tensor(
            [_seed64(p.seed) if p.seed is not None else int(fresh[i]) for i, p in enumerate(sp)],
            dtype=torch.long)
        dev = logits.device
        return sample_tokens(
            logits,
            torch.tensor([p.temperature for p in sp], dtype=torch.float32, device=dev),
            torch.tensor([p.top_k for p in sp], dtype=torch.long, device=dev),
            torch.tensor([p.top_p for p in sp], dtype=torch.float32, device=dev),
            seeds.to(dev),
            torch.tensor([r.output_index for r in rows], dtype=torch.long, device=dev),
            min_p=(torch.tensor([p.min_p for p in sp], dtype=torch.float32, device=dev)
                   if any(p.min_p > 0 for p in sp) else None),
        )


_MAX_OWED_DRAWS = 4096  # 32 KiB of seeds drawn at once, at most


def _seed64(seed: int) -> int:
    """Any Python int -> a signed 64-bit value (same bits as seed mod 2**64)."""
    s = seed & ((1 << 64) - 1)
    return s - (1 << 64) if s >= 1 << 63 else s
