"""What an engine step hands to its caller: plain data, picklable, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprobs:
    """One generated token's log-probability and the request's top-k alternatives at its
    position (k = ``SamplingParams.logprobs``; ids most likely first), from the logits
    the token was drawn from: log_softmax of the model's raw logits, before temperature,
    top-k and top-p (see ``ModelRunner.execute_with_logprobs``). Torch-free: it crosses
    Ray in the rank's reports (``rank/messages.py``) as it is."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    """New tokens of one request from one step; `finish_reason` is set exactly once, last."""

    attempt: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Engine-clock seconds (time.monotonic on the engine's host) for latency breakdowns.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    error: str | None = None
    first_scheduled_time: float | None = None  # engine clock: its first prompt chunk ran
    step_failed: bool = False  # ended by an exception inside a step (see LLMEngine.step)
    # One entry per new_token_ids entry when the request asked for logprobs, else None.
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens its prefill took from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class HandedOffFork:
    """Another choice of a handed-off prompt (n > 1): same payload, its own first token."""

    attempt: str
    first_token_id: int
    first_token_logprobs: TokenLogprobs | None = None


@dataclass
class HandOff:
    """A prefilled request leaving a PROMPT engine: its first token and its KV payload."""

    attempt: str
    first_token_id: int
    payload: Any  # its bytes, in the buffer ``LLMEngine.payload_buffer`` lent
    num_prompt_tokens: int
    # Engine-clock seconds (time.monotonic), as in RequestOutput: admitted, first prompt
    # chunk scheduled, first token sampled.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    first_token_logprobs: TokenLogprobs | None = None  # when the request asked for them
    forks: list[HandedOffFork] = field(default_factory=list)  # the payload's other choices
    num_cached_tokens: int = 0  # prompt tokens its prefill took from the prefix cache
    # KV streaming: the payload leaves out the first ``streamed_blocks`` blocks, which
    # went ahead in chunks of ``stream_of`` (the attempt the prompt was admitted under)
    streamed_blocks: int = 0
    stream_of: str = ""


@dataclass
class KVChunk:
    """KV of blocks ``first_block .. first_block + num_blocks - 1`` of a prompt still
    being prefilled, streamed ahead of its hand-off (a payload of kind "chunk")."""

    stream_of: str  # the request whose prompt it is
    key: str  # the chunk's own id: "<attempt>/kv<first block>"
    first_block: int
    num_blocks: int
    payload: Any


@dataclass
class StepOutputs:
    kind: str  # "prompt", "decode", "empty_prompt", "idle"
    outputs: list[RequestOutput] = field(default_factory=list)
    handoffs: list[HandOff] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    duration_s: float = 0.0
    num_rows: int = 0  # sequences scheduled (0 for an empty step)
    # Prefix caching: (stored?, block hash) in order, as hashes came and went this step
    cache_events: list[tuple[bool, bytes]] = field(default_factory=list)
    kv_chunks: list[KVChunk] = field(default_factory=list)  # KV streamed ahead this step


@dataclass(frozen=True)
class KVCapacity:
    """What an engine's KV cache holds (``LLMEngine.kv_capacity``): the bounds its rank's
    KV endpoint checks payloads against, and where the cache lives."""

    block_size: int
    num_blocks: int  # the reserved block 0 included
    bytes_per_block: int  # K and V of one block over the layers that keep blocks
    total_bytes: int  # every block and every state slot's sliding-window ring
    max_tokens: int  # the longest sequence it could hold (its blocks, the model's length)
    max_payload_bytes: int  # that sequence's K and V, its sliding-window ring included
    device: str  # "cpu", "cuda:0"
    dtype: str  # what its blocks hold ("float32", "float16", "bfloat16"): a hand-off's too


@dataclass
class EngineStats:
    """An engine's queues, KV use and counters: the one stats type from the engine to the
    router's ``ClusterState`` proto. The rank sends it with every poll reply as it is
    (``rank/messages.py`` ``PollReply.stats``), setting the two fields that are the rank's
    (``rank``, ``num_woken_imports``); the router keeps the latest per rank
    (``RankHandle.stats``) and turns it into the proto in one place
    (``router/server.py`` ``rank_message``). Defaults: a rank not yet heard from."""

    engine_type: str = ""
    rank: int = 0
    num_waiting: int = 0
    num_running: int = 0
    num_prompted: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    outstanding_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_empty_steps: int = 0
    num_steps: int = 0
    num_failed_steps: int = 0
    # Prefix caching (0 when off): prompt tokens looked up / found, hashes evicted,
    # blocks that hold a hash now
    cache_queried_tokens: int = 0
    cache_hit_tokens: int = 0
    cache_evictions: int = 0
    num_cached_blocks: int = 0
    # Speculative decoding (0 when off; vLLM's counters): drafts verified, tokens drafted
    # and accepted, accepted by draft position (index 0: the first drafted token)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # set by the rank, not the engine: direct hand-offs whose prefill rank woke this
    # rank through its wake channel (the ray KV transport's endpoint counts them)
    num_woken_imports: int = 0

    @property
    def kv_usage(self) -> float:
        """Share of the KV blocks in use; 0 before the engine reported any blocks."""
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks
