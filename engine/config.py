"""Engine settings: one typed dataclass, validated when an engine is built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.kernels.cbuild import ISAS
from pdserve.scheduler.config import EngineType, SchedulerConfig

DEFAULT_KV_COPY_THREADS = 2

_ENGINE_TYPES = {"normal": EngineType.NORMAL, "prompt": EngineType.PROMPT,
                 "completion": EngineType.COMPLETION}


@dataclass
class EngineConfig:
    model_dir: str
    engine_type: str = "normal"  # normal | prompt | completion
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_mb
    kv_cache_memory_mb: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    chunked_prefill: bool = True
    # Engine-argument default per the spec's table; the offline LLM passes False.
    stop_preempted_request: bool = True
    # Opt-in scheduler policy (spec section 9): see SchedulerConfig.partial_prompts_first.
    partial_prompts_first: bool = False
    # Opt-in (spec section 9): prompt steps sized to at most this many seconds by a cost
    # model fitted to measured steps (scheduler/chunk_sizer.py); None: token budget only.
    chunk_time_budget_s: float | None = None
    prefill_attempt_interval: int = 70
    prefill_any_attempt_interval: int = 100
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's choice
    compile: bool = False  # torch.compile the decode step's dense blocks (ModelRunner)
    # Decode steps as one C call where the CPU and model allow (kernels/decode_step);
    # False keeps every step on torch (e.g. to compare numerics).
    decode_kernel: bool = True
    # Which build of the C kernels runs (kernels/cbuild.py): auto (the widest vectors
    # the CPU reports), avx512, avx2 or generic; one the CPU cannot run is refused.
    kernel_isa: str = "auto"
    # Prefix caching (scheduler/PREFIX_CACHING.md): a prompt whose leading full blocks a
    # finished request computed takes them instead of recomputing them. Models with
    # sliding-window layers run without it (a hit would need the ring's state at the
    # block boundary, which the cache does not keep).
    enable_prefix_caching: bool = True
    # Threads of a KV hand-off's block copies (the export's gather, the import's
    # scatter; kernels/kv_copy.c): one core's copy is bound by the misses it keeps in
    # flight, and two measured ~1.8x one here. A short burst while the engine waits.
    kv_copy_threads: int = DEFAULT_KV_COPY_THREADS

    def __post_init__(self) -> None:
        if self.engine_type not in _ENGINE_TYPES:
            raise ValueError(
                f"engine_type must be one of {sorted(_ENGINE_TYPES)}, got {self.engine_type!r}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "kv_cache_memory_mb", "kv_copy_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_copy_threads > 64:
            raise ValueError(f"kv_copy_threads must be <= 64, got {self.kv_copy_threads}")
        if self.kernel_isa not in ("auto", *ISAS):
            raise ValueError(f"kernel_isa must be one of auto, {', '.join(ISAS)}; got "
                             f"{self.kernel_isa!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}")

    @property
    def type(self) -> EngineType:
        return _ENGINE_TYPES[self.engine_type]

    def resolve_num_kv_blocks(self, bytes_per_block: int, max_model_len: int) -> int:
        """Enough blocks for every sequence at full length, capped by the memory budget."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        wanted = self.max_num_seqs * math.ceil(max_model_len / self.block_size) + 1
        affordable = self.kv_cache_memory_mb * 2**20 // max(bytes_per_block, 1)
        return max(2, min(wanted, affordable))

    def scheduler_config(self, num_blocks: int, max_model_len: int, ring_len: int,
                         has_ring_layers: bool = False) -> SchedulerConfig:
        return SchedulerConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            # Every running or prompted sequence holds one slot; slot 0 is reserved.
            num_state_slots=2 * self.max_num_seqs + 1,
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill=self.chunked_prefill,
            stop_preempted_request=self.stop_preempted_request,
            prefill_attempt_interval=self.prefill_attempt_interval,
            prefill_any_attempt_interval=self.prefill_any_attempt_interval,
            ring_len=ring_len,
            partial_prompts_first=self.partial_prompts_first,
            chunk_time_budget_s=self.chunk_time_budget_s,
            enable_prefix_caching=self.enable_prefix_caching and not has_ring_layers,
        )
