"""Scheduler settings, checked once at construction (spec section 2)."""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass


class EngineType(enum.IntEnum):
    NORMAL = 0  # prefill and decode, chosen per step by votes
    PROMPT = 1  # prefill only; prefilled sequences are handed off
    COMPLETION = 2  # decode only; sequences arrive prefilled


@dataclass
class SchedulerConfig:
    block_size: int
    num_blocks: int  # includes the reserved id 0
    num_state_slots: int  # includes the reserved slot 0
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = False
    stop_preempted_request: bool = True
    prefill_attempt_interval: int = 70  # ALL points
    prefill_any_attempt_interval: int = 100  # ANY points
    prefill_watermark: float = 0.9
    prefill_max_sum_seqlen_k: int | None = None  # None: no limit
    cp_size: int = 1
    lookahead_tokens: int = 0
    ring_len: int = 134
    # Opt-in policies (spec section 9); defaults reproduce the released engine.
    continuation_at_back: bool = False
    hol_bypass_limit: int = 0  # K > 0: a smaller request may pass a LATER head K times
    decode_room_needs_no_block: bool = False
    # A partly prefilled prompt already owns blocks for its whole prompt: let it finish
    # before a recompute-preempted request retakes the head, and past the watermark,
    # so the pool can never wedge with every free block held by unfinished prompts.
    partial_prompts_first: bool = False
    # Time-budget chunk sizer (scheduler/chunk_sizer.py): prompt steps sized to take at
    # most this many seconds by a cost model fitted to measured steps; None: off. Needs
    # chunked_prefill (a prompt longer than the budget must be split).
    chunk_time_budget_s: float | None = None
    # Prefix caching (scheduler/PREFIX_CACHING.md): full blocks keep their KV, named by
    # a hash of their history, for later requests with the same prefix. Off here so the
    # chapter's rules (S1-S37) read as written; the engine turns it on by default.
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        for name, low in (
            ("block_size", 1), ("num_blocks", 2), ("num_state_slots", 2), ("max_model_len", 1),
            ("max_num_seqs", 1), ("prefill_attempt_interval", 1),
            ("prefill_any_attempt_interval", 1), ("cp_size", 1), ("lookahead_tokens", 0),
            ("ring_len", 1), ("hol_bypass_limit", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(self.max_model_len, 4096, self.max_num_seqs)
        elif self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"block_size ({self.block_size})"
            )
        budget = self.chunk_time_budget_s
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0:
                raise ValueError(f"chunk_time_budget_s must be a number > 0 or None, got {budget!r}")
            if not self.chunked_prefill:
                raise ValueError("chunk_time_budget_s needs chunked_prefill=True: prompts "
                                 "longer than a step's budget are split")
        if not 0.0 <= self.prefill_watermark <= 1.0:
            raise ValueError(f"prefill_watermark must be in [0, 1], got {self.prefill_watermark}")
        limit = self.prefill_max_sum_seqlen_k
        if limit is not None and limit < self.prompt_limit:
            raise ValueError(
                f"prefill_max_sum_seqlen_k ({limit}) must be >= prompt_limit ({self.prompt_limit})"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            warnings.warn(
                f"chunked_prefill is off and max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" < max_model_len ({self.max_model_len}): longer prompts will be ignored",
                stacklevel=3,
            )

    @property
    def cp_align(self) -> int:
        return 1 if self.cp_size == 1 else 2 * self.cp_size

    @property
    def prompt_limit(self) -> int:
        if self.chunked_prefill:
            return self.max_model_len
        return min(self.max_model_len, self.max_num_batched_tokens)

    def check_engine_type(self, engine_type: EngineType) -> None:
        if engine_type == EngineType.COMPLETION and not self.stop_preempted_request:
            raise ValueError(
                "stop_preempted_request must be True for a COMPLETION engine: it has no "
                "prefill path to recompute a preempted request on"
            )
