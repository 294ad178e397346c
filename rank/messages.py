"""Everything that crosses Ray between the router and an engine rank, as typed data.

This is the one file to read to know the router <-> rank contract. Plain dataclasses,
no torch (the router imports this module), picklable by Ray as they are.

Two of the engine's own plain types (``engine/outputs.py``, torch-free) cross as they
are and are part of this contract: ``TokenLogprobs`` (a token's logprobs) and
``EngineStats`` (a rank's queues, KV use and counters, in every ``PollReply``). The
rest of an engine step (``StepOutputs``) becomes a ``StepReport`` in one place: the
``of`` constructors below (``StepReport.of``, ``TokenReport.of``, ``HandoffTicket.of``,
``HandedOffChoice.of``, ``KVChunkTicket.of``), which add what only the rank knows (where
a KV payload waits, the rank's timings).

Identity: engines, payloads, transports and reports know a request only by its
*attempt key* (``AttemptKey``): the router's internal request id, which no client can
choose or predict, plus the number of this dispatch of it. A client's id
is a label that never leaves the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The engine's own plain dataclasses (engine/outputs.py, torch-free): TokenLogprobs and
# EngineStats are carried as they are (part of this contract); the others are what the
# ``of`` constructors below turn into reports.
from pdserve.engine.outputs import (
    EngineStats,
    HandedOffFork,
    HandOff,
    KVChunk,
    RequestOutput,
    StepOutputs,
    TokenLogprobs,
)
from pdserve.kv_transfer.base import DeliveryResult
from pdserve.kv_transfer.base import FailureKind as FailureKind  # part of the contract
from pdserve.scheduler.sampling_params import SamplingParams

# Bounds the router gives every rank it starts (RouterConfig's fields of the same names
# take these defaults); a rank built without a router (tests) takes the same.
DEFAULT_COLLECTIVE_TIMEOUT_S = 10.0  # joining a data-parallel group, its collectives
DEFAULT_MAX_FAILED_STEPS = 3  # failed steps in a row before a rank reports itself fatal
DEFAULT_POLL_TIMEOUT_S = 0.5  # how long one poll of a rank waits for a step report


class AttemptKey(str):
    """One dispatch of one request, as the text ``"<request>.<number>"``: the router's
    internal id (random, never a client's label) and the number of this dispatch (1,
    then +1 for each retry or move). A ``str``: the engine, its payloads and the KV
    transports below the rank take it as the plain key they know, and only the router
    reads its parts."""

    __slots__ = ()

    def __new__(cls, text: str) -> AttemptKey:
        request, dot, number = str(text).rpartition(".")
        if not dot or not request or not number.isdigit():
            raise ValueError(f"an attempt key is '<request>.<number>', got {text!r:.100}")
        return super().__new__(cls, text)

    @classmethod
    def of(cls, request: str, number: int) -> AttemptKey:
        return cls(f"{request}.{number}")

    @classmethod
    def parse(cls, text: str) -> AttemptKey | None:
        """The key ``text`` spells, or None if it spells none."""
        try:
            return cls(text)
        except ValueError:
            return None

    @property
    def request(self) -> str:
        return self.rpartition(".")[0]

    @property
    def number(self) -> int:
        return int(self.rpartition(".")[2])


@dataclass(frozen=True)
class RankInfo:
    """What a rank says of itself when it starts."""

    pool: str
    engine_type: str
    pid: int
    node_id: str
    host: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    num_total_blocks: int
    kv_address: str | None = None  # the gRPC KV endpoint, for the grpc transport
    # where the engine's KV lives ("cpu", "cuda:0") and, on CUDA, the GPU's UUID: the
    # device transport's pair backend (NCCL between two different GPUs)
    device: str = "cpu"
    gpu_uuid: str = ""
    # what its KV blocks hold ("float16", ...): a decode rank imports a prefill rank's as
    # they are, so the router refuses to serve pools whose ranks disagree
    kv_dtype: str = ""
    # the torch threads its steps may run on (PoolConfig.threads)
    threads: int = 0
    # a COMPLETION rank's wake channel on its node (ray transport; kv_transfer/ray/wake_channel.py)
    wake_address: str = ""


@dataclass
class RankTimings:
    """Durations in seconds on the rank's own clock, for the router's TTFT breakdown."""

    prefill_queue_s: float | None = None
    prefill_s: float | None = None
    kv_export_s: float | None = None
    decode_queue_s: float | None = None
    # not durations: when (time.time()) the prefill rank sampled the first token (its
    # prompt's KV all computed) and the decode rank took the payload: the hand-off's span
    kv_ready_wall: float | None = None
    kv_imported_wall: float | None = None

    def items(self) -> list[tuple[str, float]]:
        return [(k, v) for k, v in vars(self).items() if v is not None]


@dataclass
class AddRequest:
    """Start an attempt on a NORMAL or PROMPT rank: ``prompt_token_ids`` is the whole
    history to compute (a moved request's prompt plus the tokens already streamed)."""

    attempt: AttemptKey
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # n > 1: the other choices of this prompt, prefilled once with it (their first
    # tokens drawn from the same logits) and handed off in the same payload.
    forks: list[ForkSpec] = field(default_factory=list)
    # PROMPT: stream the prompt's KV ahead in chunks while it computes (KVChunkTicket)
    stream_kv: bool = False
    # moved off a rank that died, left or failed: it queues ahead of new arrivals
    moved: bool = False


@dataclass
class ForkSpec:
    attempt: AttemptKey
    sampling: SamplingParams


@dataclass
class AdmitResult:
    ok: bool
    error: str = ""


# A decode rank's answer to an import (``import_prefilled``, ``import_shared``,
# ``kv_send`` / ``kv_receive``): part of this contract, but one type with the router's
# delivery outcome, defined once in kv_transfer/base.py: ok, attempt, kind (a
# ``FailureKind``, set where the failure is known: payload, capacity, cache_miss,
# transport; ray's unreachable), error, nbytes (the payload's size as it arrived).
ImportResult = DeliveryResult


@dataclass
class TokenReport:
    """One attempt's new tokens from one step; ``finish_reason`` is set once, last.

    ``num_output_tokens`` counts every token this attempt has produced so far, so the
    router can tell a lost report (a gap) from a late one. ``step_failed`` marks an
    attempt ended by an exception inside a step (the request may move). ``logprobs``:
    one entry per ``token_ids`` entry when the request asked for them, else None."""

    attempt: AttemptKey
    token_ids: list[int]
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    step_failed: bool = False
    timings: RankTimings | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens this attempt's prefill took from the cache

    @classmethod
    def of(cls, output: RequestOutput) -> TokenReport:
        """The report of one engine output (the rank adds ``timings`` where it has them)."""
        return cls(AttemptKey(output.attempt), list(output.new_token_ids),
                   output.num_output_tokens,
                   finish_reason=output.finish_reason, error=output.error,
                   step_failed=output.step_failed, logprobs=output.new_logprobs,
                   num_cached_tokens=output.num_cached_tokens)


@dataclass
class HandoffTicket:
    """A prefilled attempt leaving a PROMPT rank: its first token and where its KV
    payload waits (``locator`` belongs to the transport that made it)."""

    attempt: AttemptKey
    first_token_id: int
    num_prompt_tokens: int
    nbytes: int
    locator: Any
    timings: RankTimings | None = None
    first_token_logprobs: TokenLogprobs | None = None  # when the request asked for them
    # n > 1: the other choices in the same payload, each with its own first token
    forks: list[HandedOffChoice] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens its prefill took from the prefix cache
    # KV streaming: the payload leaves out the first ``streamed_blocks`` blocks, which went
    # ahead as the chunks of attempt ``stream_of`` (KVChunkTicket); a decode rank needs
    # them all before this payload
    streamed_blocks: int = 0
    stream_of: AttemptKey | None = None
    # a direct hand-off (router/kv_stream.py): the import this rank already asked of the
    # stream's decode rank (a Ray ObjectRef of its ImportResult), None if it did not
    direct_import: Any = None

    @classmethod
    def of(cls, handoff: HandOff, locator: Any, timings: RankTimings | None = None,
           direct_import: Any = None) -> HandoffTicket:
        """The ticket of an engine's hand-off whose payload the rank's transport endpoint
        exported to ``locator``."""
        return cls(AttemptKey(handoff.attempt), int(handoff.first_token_id),
                   int(handoff.num_prompt_tokens), len(handoff.payload), locator, timings,
                   first_token_logprobs=handoff.first_token_logprobs,
                   forks=[HandedOffChoice.of(f) for f in handoff.forks],
                   num_cached_tokens=handoff.num_cached_tokens,
                   streamed_blocks=handoff.streamed_blocks,
                   stream_of=AttemptKey(handoff.stream_of) if handoff.stream_of else None,
                   direct_import=direct_import)

    @property
    def key(self) -> str:
        """What the transport holds its payload under (as a KVChunkTicket's ``key``)."""
        return self.attempt

    @property
    def choices(self) -> list[HandedOffChoice]:
        """Every choice the payload carries, its lead (``attempt``) first."""
        lead = HandedOffChoice(self.attempt, self.first_token_id, self.first_token_logprobs)
        return [lead, *self.forks]


@dataclass
class HandedOffChoice:
    attempt: AttemptKey
    first_token_id: int
    first_token_logprobs: TokenLogprobs | None = None

    @classmethod
    def of(cls, fork: HandedOffFork) -> HandedOffChoice:
        return cls(AttemptKey(fork.attempt), int(fork.first_token_id),
                   fork.first_token_logprobs)


@dataclass
class KVChunkTicket:
    """KV streamed ahead of a hand-off: blocks ``first_block ..`` of attempt
    ``stream_of``'s prompt, exported under its own ``key`` (what the transport moves,
    releases and discards, as it does a HandoffTicket's attempt)."""

    key: str
    stream_of: AttemptKey
    first_block: int
    num_blocks: int
    nbytes: int
    locator: Any

    @classmethod
    def of(cls, chunk: KVChunk, locator: Any) -> KVChunkTicket:
        """The ticket of a streamed chunk the rank's transport endpoint exported."""
        return cls(chunk.key, AttemptKey(chunk.stream_of), chunk.first_block, chunk.num_blocks,
                   len(chunk.payload), locator)


@dataclass
class StepReport:
    kind: str
    outputs: list[TokenReport] = field(default_factory=list)
    handoffs: list[HandoffTicket] = field(default_factory=list)
    # Prefix caching: (stored?, block hash) as the rank's cache changed, in order; the
    # router's index of which rank holds which prefix (cache-aware routing)
    cache_events: list[tuple[bool, bytes]] = field(default_factory=list)
    kv_chunks: list[KVChunkTicket] = field(default_factory=list)  # in the order made

    @classmethod
    def of(cls, step: StepOutputs, handoffs: list[HandoffTicket],
           kv_chunks: list[KVChunkTicket]) -> StepReport:
        """One engine step's report: its outputs and cache events as they are, with the
        tickets of the hand-offs and KV chunks the rank exported from it."""
        return cls(step.kind, [TokenReport.of(o) for o in step.outputs], handoffs,
                   step.cache_events, kv_chunks)


@dataclass
class PollReply:
    """Every step report since the last poll, and the rank's health.

    ``loop_error``: the engine loop stopped (its group must re-form); ``fatal``: the
    rank gave up (steps kept failing) and must be replaced."""

    steps: list[StepReport]
    stats: EngineStats  # the engine's, with the rank's own fields set (engine/outputs.py)
    generation: int
    loop_error: str | None = None
    fatal: bool = False


@dataclass
class GroupJoined:
    rank: int
    world_size: int
    generation: int
