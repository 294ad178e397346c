"""Engine settings: one typed dataclass, validated when it is built.

``EngineSettings`` is everything a serve config's ``engine:`` mapping (router/config.py,
``PoolConfig.engine``) and ``LLM(...)`` take: the scheduler's policy
(``SchedulerPolicy``, scheduler/config.py: each of its fields is declared there, once)
plus the engine's own (KV memory, dtype, device, kernels). ``EngineConfig`` adds what a
rank or ``LLM`` decides itself: the model and the engine type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pdserve.kernels.cbuild import ISAS
from pdserve.scheduler.config import EngineType, SchedulerConfig, SchedulerPolicy
from pdserve.scheduler.field_checks import Bool, Integer, OneOf, OrNone, checked

DEFAULT_KV_COPY_THREADS = 2
DEFAULT_KV_CACHE_MB = 512

_ENGINE_TYPES = {"normal": EngineType.NORMAL, "prompt": EngineType.PROMPT,
                 "completion": EngineType.COMPLETION}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "int8", "bf16", "none")  # EngineSettings.quantization
ACTIVATION_PRECISIONS = ("auto", "fp32", "int8")  # EngineSettings.activation_precision
KV_PRECISIONS = ("auto", "fp32", "fp16")  # EngineSettings.kv_precision
SPECULATIVE_METHODS = ("off", "ngram", "draft")  # EngineSettings.speculative
KERNEL_ISAS = ("auto", *ISAS)  # EngineSettings.kernel_isa
MIN_KV_BLOCKS, MAX_KV_BLOCKS = 16, 8192  # what a memory budget is turned into


def check_device(device: str) -> None:
    """ValueError naming the field unless ``device`` is auto, cpu, cuda or cuda:N."""
    index = device[5:] if isinstance(device, str) and device.startswith("cuda:") else None
    if device not in ("auto", "cpu", "cuda") and not (index and index.isdigit()):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")


def engine_device(device: str, cuda_available: bool) -> str:
    """The device an engine runs on: ``auto`` the GPU where there is one, else the CPU.
    A GPU asked for where there is none is a ValueError saying so."""
    if device == "auto":
        return "cuda" if cuda_available else "cpu"
    if device.startswith("cuda") and not cuda_available:
        raise ValueError(f"device {device}: torch sees no GPU here (torch.cuda.is_available() "
                         "is False; a CPU build of torch, or no driver)")
    return device


def engine_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on a GPU, float32 on the CPU."""
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return dtype


def state_slots_for(max_num_seqs: int) -> int:
    """The scheduler's state slots: one for every running or prompted sequence (at most
    ``max_num_seqs`` of each), slot 0 reserved."""
    return 2 * max_num_seqs + 1


def kv_blocks_in(budget_bytes: int, bytes_per_block: int, ring_bytes: int = 0) -> int:
    """The KV blocks a memory budget holds once the sliding-window rings (``ring_bytes``)
    are taken, between MIN_KV_BLOCKS and MAX_KV_BLOCKS; ``bytes_per_block`` 0 (no layer
    keeps blocks) gives the minimum. ValueError when the minimum does not fit. The one
    rule the runner sizes its cache by and the simulator sizes its ranks by."""
    left = budget_bytes - ring_bytes
    if bytes_per_block and left < MIN_KV_BLOCKS * bytes_per_block:
        raise ValueError(
            f"KV cache budget {budget_bytes / 2**20:.0f} MiB is too small: the "
            f"sliding-window rings take {ring_bytes / 2**20:.0f} MiB and {MIN_KV_BLOCKS} "
            f"blocks need {MIN_KV_BLOCKS * bytes_per_block / 2**20:.1f} MiB more")
    return int(max(MIN_KV_BLOCKS, min(MAX_KV_BLOCKS, left // max(bytes_per_block, 1))))


@dataclass(kw_only=True)
class EngineSettings(SchedulerPolicy):
    """The scheduler's policy (inherited, see SchedulerPolicy) plus the engine's own;
    each field declares what it accepts (scheduler/field_checks.py)."""

    # None: sized from kv_cache_memory_mb; at least 2 (block 0 is reserved)
    num_kv_blocks: int | None = checked(None, OrNone(Integer(ge=2)))
    kv_cache_memory_mb: int = checked(DEFAULT_KV_CACHE_MB, Integer(ge=1))
    # None: the model's max_position_embeddings
    max_model_len: int | None = checked(None, OrNone(Integer(ge=1)))
    # "auto": bfloat16 on a GPU (half the bytes of every weight and KV read; tensor
    # cores), float32 on the CPU (its C kernels' exact path)
    dtype: str = checked("auto", OneOf(_DTYPES))
    # "auto": the GPU where torch sees one (LLM), or where the rank's pool asked Ray for
    # GPUs (num_gpus > 0; `pdserve serve` gives the pools GPUs where the cluster has
    # them); "cpu" or "cuda" ("cuda:N") to force.
    device: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's choice
    compile: bool = False  # torch.compile the decode step's dense blocks (ModelRunner)
    # Decode steps as one C call where the CPU and model allow (kernels/decode_step);
    # False keeps every step on torch (e.g. to compare numerics).
    decode_kernel: bool = True
    # Which build of the C kernels runs (kernels/cbuild.py): auto (the widest vectors
    # the CPU reports), avx512, avx2 or generic; one the CPU cannot run is refused.
    kernel_isa: str = checked("auto", OneOf(KERNEL_ISAS))
    # The weights the C decode step reads (engine/model/quantized_weights.py): "auto" a GGUF
    # file's Q8_0 / Q4_0 / Q4_1 matmuls as the file holds them (int8 values or nibbles, a
    # scale and offset per 32), other weights fp32; "int8" also every other matmul,
    # quantized at load (symmetric, per 32 of a row; every path then computes with the
    # quantized weights); "bf16" every other matmul rounded to bf16 at load (half of
    # fp32's bytes; exact for a bf16 checkpoint; activations stay fp32); "none": every
    # step reads fp32 weights.
    quantization: str = checked("auto", OneOf(QUANTIZATIONS))
    # What the quantized matmuls multiply their weights by (kernels/dot_block.h): "int8"
    # rows of x quantized per tile of the weights (8 values for nibbles, 4 for int8
    # values; the largest magnitude to at most 127 steps) and integer dot products, as
    # llama.cpp computes on the same files (about 3x fewer instructions a weight;
    # perplexity within 0.1%); "fp32" the exact activations;
    # "auto" int8 for a GGUF file's integer blocks (the file's author chose
    # quantization) but the attention's q|k|v, fp32 for those and for weights quantized
    # at load (engine/model/quantized_weights.int8_rows_for says why).
    activation_precision: str = checked("auto", OneOf(ACTIVATION_PRECISIONS))
    # What the KV cache holds on the CPU (engine/model_runner.kv_dtype): "fp16" keys and
    # values rounded to half precision (half the bytes for attention to read and twice
    # the blocks in the same memory; every path attends to the rounded values); "fp32"
    # exact; "auto" fp16 where the quantized matmuls multiply int8 activations (a GGUF
    # file's blocks, as llama.cpp's f16 cache), else the model's dtype. A GPU's cache
    # holds the model's dtype.
    kv_precision: str = checked("auto", OneOf(KV_PRECISIONS))
    # Threads of a KV hand-off's block copies (the export's gather, the import's
    # scatter; kernels/kv_copy.c): one core's copy is bound by the misses it keeps in
    # flight, and two measured ~1.8x one here. A short burst while the engine waits.
    kv_copy_threads: int = checked(DEFAULT_KV_COPY_THREADS, Integer(ge=1, le=64))
    # Speculative decoding on the ranks that decode (engine/speculative/decoding.py): "ngram"
    # drafts by prompt lookup over each request's own history; a draft's size follows
    # the request's acceptance and the measured step costs, up to
    # num_speculative_tokens, and none is used where it would not pay.
    speculative: str = checked("off", OneOf(SPECULATIVE_METHODS))
    num_speculative_tokens: int = checked(5, Integer(ge=1, le=16))
    # the n-gram sizes matched ("ngram"): the longest that ends the history first;
    # ngram_min <= ngram_max
    ngram_min: int = checked(2, Integer(ge=1))
    ngram_max: int = checked(4, Integer(ge=1, le=16))
    # False: every draft is checked whatever the measured step costs say (vLLM's way;
    # for measuring, and for tests that must see drafts)
    speculative_adaptive: bool = checked(True, Bool())
    # "draft": a smaller model sharing the target's tokenizer (a folder, a GGUF file or a
    # built-in name), with a KV cache of its own on each decoding rank
    draft_model: str | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError, its text starting with the field's name, for a bad setting: each
        field's declared check, then the rules between fields."""
        self.check_policy()  # every field's declared check, this class's too
        check_device(self.device)
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model must be set exactly when speculative is draft, got "
                             f"speculative {self.speculative!r}, draft_model "
                             f"{self.draft_model!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min must be <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "engine") -> EngineSettings:
        """Settings from plain data (a YAML ``engine:`` mapping); a ValueError names the
        field as ``<where>.<field>`` (e.g. ``prefill.engine.max_num_seqs``)."""
        known = {f.name for f in fields(cls)}
        fixed = sorted({"model_dir", "engine_type"} & set(data))
        if fixed:
            raise ValueError(f"{where}: {', '.join(f'{where}.{k}' for k in fixed)} is set by "
                             "the router, not in a pool's engine settings")
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown engine setting(s) "
                             f"{', '.join(f'{where}.{k}' for k in unknown)}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{where}.{exc}") from None

    def settings(self) -> dict[str, Any]:
        """Every EngineSettings field and its value (what ships to a rank)."""
        return {f.name: getattr(self, f.name) for f in fields(EngineSettings)}


@dataclass(kw_only=True)
class EngineConfig(EngineSettings):
    model_dir: str
    engine_type: str = checked("normal", OneOf(tuple(_ENGINE_TYPES)))  # normal, prompt, completion

    @property
    def type(self) -> EngineType:
        return _ENGINE_TYPES[self.engine_type]

    def resolve_num_kv_blocks(self, bytes_per_block: int, ring_bytes: int = 0) -> int:
        """The KV blocks these settings give a rank whose model keeps
        ``bytes_per_block`` per block (and ``ring_bytes`` of sliding-window rings)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return kv_blocks_in(self.kv_cache_memory_mb << 20, bytes_per_block, ring_bytes)

    def scheduler_config(self, num_blocks: int, max_model_len: int, ring_len: int,
                         has_ring_layers: bool = False) -> SchedulerConfig:
        """The scheduler's config: this policy as it is (every SchedulerPolicy field)
        plus the sizes the engine derived."""
        policy = {f.name: getattr(self, f.name) for f in fields(SchedulerPolicy)}
        # Sliding-window layers: no prefix caching (a hit would need the ring's state at
        # the block boundary, which the cache does not keep).
        policy["enable_prefix_caching"] = self.enable_prefix_caching and not has_ring_layers
        return SchedulerConfig(
            **policy,
            num_blocks=num_blocks,
            num_state_slots=state_slots_for(self.max_num_seqs),
            max_model_len=max_model_len,
            ring_len=ring_len,
        )
