"""One request inside an engine: its history, progress counters and resources (spec section 1)."""

from __future__ import annotations

import enum
import itertools
import time

from pdserve.scheduler.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2  # a name only: nothing sets it (no swap path, as in the studied engine)
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    FINISHED_PREEMPTED = 7
    FINISHED_SO_FAILED = 8

    def __init__(self, value: int) -> None:
        # Plain attributes, not properties: the decode loop reads them for every row.
        self.is_finished = value >= 3
        self.finish_reason: str | None = None


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "prompt_length_exceeded",
    SequenceStatus.FINISHED_PREEMPTED: "insufficient_system_resource",
    SequenceStatus.FINISHED_SO_FAILED: "structured_output_failed",
}
for _status, _reason in _FINISH_REASONS.items():
    _status.finish_reason = _reason

# Breaks ties between equal arrival times so "arrival order" is always total.
_creation_order = itertools.count()


class Sequence:
    """History = prompt + generated tokens; `processed` positions have KV rows in the cache.

    `in_flight` counts positions handed to the device whose results are not processed
    yet, so a sequence can be scheduled again before its previous step comes back.
    """

    __slots__ = (
        "attempt", "token_ids", "prompt_len", "sampling", "eos_token_id", "arrival_time",
        "order", "processed", "in_flight", "draft_len", "draft_token_ids", "block_table",
        "state_slot", "status",
        "so_status", "schedulable", "checkpoints", "first_scheduled_time", "first_token_time",
        "fork_pending",
        "forks",
        "fork_of",
        "block_hashes",
        "num_registered",
        "num_cached_tokens",
        "bypassed", "retired", "moved",
    )

    def __init__(
        self,
        attempt: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        arrival_time: float | None = None,
        eos_token_id: int | None = None,
        forks: list[tuple[str, SamplingParams]] | tuple = (),
        moved: bool = False,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"prompt_token_ids of request {attempt!r} must not be empty")
        self.attempt = attempt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.order = next(_creation_order)
        self.processed = 0
        self.in_flight = 0
        # Speculative decoding: the tokens proposed to follow the history, verified by the
        # next decode step (its row computes 1 + draft_len positions); cleared after it.
        self.draft_len = 0
        self.draft_token_ids: list[int] = []
        self.block_table: list[int] = []
        self.state_slot = -1
        self.status = SequenceStatus.WAITING
        # 0 none/inactive, 1 active (a guided request: its forks take it too), -1 failed
        self.so_status = 1 if self.sampling.guide is not None else 0
        self.schedulable = True
        self.checkpoints: list[int] = []  # ascending prompt positions a chunk may not cross
        self.first_scheduled_time: float | None = None  # first prompt chunk scheduled (engine clock)
        self.first_token_time: float | None = None
        self.fork_pending = False  # holds a parent's pinned blocks until it gets its own copies
        # n > 1: (attempt, sampling) of each sibling that forks from this sequence when
        # its prompt completes, sharing the prompt's KV (S34); empty once forked.
        self.forks: list[tuple[str, SamplingParams]] = list(forks)
        self.fork_of: str | None = None  # the attempt this one was forked from
        # Prefix caching: hashes of its history's full blocks (as far as computed), how
        # many of its blocks carry theirs in the pool, and the prompt tokens it took
        # from the cache when it was first scheduled.
        self.block_hashes: list[bytes] = []
        self.num_registered = 0
        self.num_cached_tokens = 0
        self.bypassed = 0  # how often a smaller request passed it (opt-in bypass policy)
        self.retired = False  # resources freed and finish reported: guards "exactly once"
        # moved here off a rank that died, left or failed: it has waited already, so it
        # queues ahead of fresh arrivals (Scheduler.add)
        self.moved = moved

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.attempt!r}, len={len(self)}, processed={self.processed}, "
            f"in_flight={self.in_flight}, status={self.status.name}, blocks={self.block_table})"
        )

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.prompt_len]

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def drop_forks(self, attempt: str | None = None) -> None:
        """Forks not made yet that never will be: ``attempt``'s, or all of them."""
        self.forks = [] if attempt is None else [f for f in self.forks if f[0] != attempt]

    def reset_for_recompute(self) -> None:
        """Forget cache progress only: history, sampling and structured-output state stay,
        so the next prefill rebuilds the whole history and the answer continues (S30, S31)."""
        self.processed = 0
        self.in_flight = 0
        self.draft_len = 0  # Listing 5.10: draft state cleared
        self.draft_token_ids = []
