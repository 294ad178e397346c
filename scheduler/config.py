"""Scheduler settings, checked once at construction (spec section 2).

Two classes, each setting declared once:

- ``SchedulerPolicy``: every setting a user picks (batch limits, chunking, the
  prefill-attempt intervals, the opt-in policies of spec section 9, prefix caching).
  ``EngineConfig`` (engine/config.py) extends it, so each one is a field of a serve
  config's ``engine:`` mapping, an ``LLM(...)`` keyword and an ``EngineConfig`` field,
  under the same name and with the default written here.
- ``SchedulerConfig``: the policy plus the sizes the engine derives from its model and
  memory (``num_blocks``, ``num_state_slots``, ``max_model_len``, ``ring_len``).

Defaults are the service's and the offline API's (the engine's): up to 64 sequences,
chunked prefill and prefix caching on. The spec's own table (256 sequences, no chunked
prefill, no prefix caching) is what the scheduler's rule tests pass explicitly.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

from pdserve.scheduler.field_checks import (
    REQUIRED,
    Bool,
    Integer,
    Number,
    OrNone,
    check_fields,
    checked,
)

# Tokens per KV block: the one default of the engine, the scheduler, the model runner and
# the router (which learns the ranks' actual size when they start).
DEFAULT_BLOCK_SIZE = 16


class EngineType(enum.IntEnum):
    NORMAL = 0  # prefill and decode, chosen per step by votes
    PROMPT = 1  # prefill only; prefilled sequences are handed off
    COMPLETION = 2  # decode only; sequences arrive prefilled


@dataclass(kw_only=True)
class SchedulerPolicy:
    """The scheduler's settings a user picks; see the module's docstring. Each field
    declares what it accepts (scheduler/field_checks.py); check_policy runs those and
    the rules between fields."""

    block_size: int = checked(DEFAULT_BLOCK_SIZE, Integer(ge=1))
    max_num_seqs: int = checked(64, Integer(ge=1))
    # None: max(max_model_len, 4096, max_num_seqs), decided by SchedulerConfig.
    max_num_batched_tokens: int | None = checked(None, OrNone(Integer()))
    chunked_prefill: bool = checked(True, Bool())
    # A preempted request ends (insufficient_system_resource) rather than being
    # recomputed; the offline LLM passes False (the spec's table).
    stop_preempted_request: bool = checked(True, Bool())
    prefill_attempt_interval: int = checked(70, Integer(ge=1))  # ALL points
    prefill_any_attempt_interval: int = checked(100, Integer(ge=1))  # ANY points
    prefill_watermark: float = checked(0.9, Number(ge=0, le=1))
    # None: no limit; SchedulerConfig checks it against the prompt limit.
    prefill_max_sum_seqlen_k: int | None = checked(None, OrNone(Integer()))
    cp_size: int = checked(1, Integer(ge=1))
    lookahead_tokens: int = checked(0, Integer(ge=0))
    # Opt-in policies (spec section 9); defaults reproduce the released engine.
    continuation_at_back: bool = checked(False, Bool())
    # K > 0: a smaller request may pass a LATER head K times
    hol_bypass_limit: int = checked(0, Integer(ge=0))
    decode_room_needs_no_block: bool = checked(False, Bool())
    # A preempted sequence with an active structured-output matcher is recomputed (its
    # matcher kept, or replayed over its answer) instead of ended (S30's default).
    recompute_structured_output: bool = checked(False, Bool())
    # A partly prefilled prompt already owns blocks for its whole prompt: let it finish
    # before a recompute-preempted request retakes the head, and past the watermark,
    # so the pool can never wedge with every free block held by unfinished prompts.
    # The offline LLM turns it on (it recomputes preempted requests).
    partial_prompts_first: bool = checked(False, Bool())
    # Time-budget chunk sizer (scheduler/chunk_sizer.py): prompt steps sized to take at
    # most this many seconds by a cost model fitted to measured steps; None: off. Needs
    # chunked_prefill (a prompt longer than the budget must be split).
    chunk_time_budget_s: float | None = checked(None, OrNone(Number(gt=0)))
    # Prefix caching (scheduler/PREFIX_CACHING.md): full blocks keep their KV, named by
    # a hash of their history, for later requests with the same prefix. The chapter's
    # rules (S1-S37) are written, and tested, with it off. Models with sliding-window
    # layers run without it (the engine turns it off for them).
    enable_prefix_caching: bool = checked(True, Bool())

    def check_policy(self) -> None:
        """ValueError (starting with the field's name) for a policy out of range: every
        field's declared check (a subclass's fields too), then the rules between the
        policy's fields; what needs the derived sizes is checked by SchedulerConfig."""
        check_fields(self)
        self._check_batched_tokens()
        if self.chunk_time_budget_s is not None and not self.chunked_prefill:
            raise ValueError("chunk_time_budget_s needs chunked_prefill=True: prompts "
                             "longer than a step's budget are split")

    def _check_batched_tokens(self) -> None:
        tokens = self.max_num_batched_tokens
        for name in ("max_num_seqs", "block_size"):
            if tokens is not None and tokens < getattr(self, name):
                raise ValueError(f"max_num_batched_tokens ({tokens}) must be >= {name} "
                                 f"({getattr(self, name)})")


@dataclass(kw_only=True)
class SchedulerConfig(SchedulerPolicy):
    """The policy plus the sizes the engine derives (its model, its KV memory)."""

    num_blocks: int = checked(REQUIRED, Integer(ge=2))  # includes the reserved id 0
    num_state_slots: int = checked(REQUIRED, Integer(ge=2))  # includes the reserved slot 0
    max_model_len: int = checked(REQUIRED, Integer(ge=1))
    ring_len: int = checked(134, Integer(ge=1))

    def __post_init__(self) -> None:
        self.check_policy()
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(self.max_model_len, 4096, self.max_num_seqs)
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"block_size ({self.block_size})"
            )
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
