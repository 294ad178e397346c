"""Speculative decoding on a decoding engine: drafts proposed before the step, verified
by it, and never a slower step than decoding one token.

1. Before each step, ``Speculator.propose`` gives each running sequence a draft (its
   ``draft_token_ids``; ``draft_len`` counts it in the blocks it needs, spec S4): the
   tokens a ``Proposer`` expects to follow its history, as many as the sequence's own
   acceptance and the measured step costs say pay (``plan_draft_lens``). A draft never
   costs a preemption: the scheduler drops it first (scheduler/decode_path.py).
2. The decode step computes the row's last token and every drafted one at their
   positions, each a row of the C decode step sharing the sequence's block table
   (``engine/step_inputs.runner_rows``), and samples a token after each as a plain
   decode step would (same logits controls, same seeded draws by position).
3. ``verify``: drafted token j is accepted while it equals the token sampled after the
   ones before it; the sequence gets the accepted drafts and the token sampled after
   them. Each emitted token is the one non-speculative decoding would draw from the
   same history (greedy: argmax; seeded: the draw keyed by seed and position), so
   outputs are exactly those of decoding without a draft, and a moved request goes on
   token for token. The KV rows of rejected positions lie past the sequence's processed
   count: the next tokens overwrite them.
4. Stop strings, EOS, ``max_tokens`` and the grammar apply to the emitted tokens only
   (the scheduler's stop rules, token by token). A recomputed sequence's draft is
   cleared (Listing 5.10).

Proposers: ``NgramProposer`` (prompt lookup over the sequence's own history, vLLM's
``ngram`` method). The interface leaves room for draft models and MTP heads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.model.catalog import resolve_model
from pdserve.engine.speculative.draft_model import DraftModelProposer
from pdserve.scheduler.config import EngineType
from pdserve.scheduler.sequence import Sequence

ACCEPTANCE_PRIOR = 0.5  # a new request's acceptance rate before it has any
ACCEPTANCE_DECAY = 0.8  # weight of the past in a request's acceptance estimate
BUSY_GAP_S = 0.1  # a longer gap between two decode steps is idleness, not overhead
PROBE_EVERY = 8  # steps between two tries of a draft size whose cost is unknown


class Proposer(Protocol):
    # True for a proposer that costs a model run (a draft model): the draft sizes are
    # planned before it proposes, so it drafts only as many tokens as will be checked
    plans_first: bool

    def propose_many(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """Up to k tokens expected to follow each (attempt, history, k)."""

    def forget(self, attempt: str) -> None:
        """The request ended: drop what the proposer keeps of it."""


class NgramProposer:
    """Prompt lookup: the longest n-gram (``min_n`` ..= ``max_n`` tokens) that ends the
    history and occurred before, and the tokens that followed its latest occurrence.

    Each request keeps an index of its n-grams (where each last ended), grown by the
    tokens added since its previous step, so a step costs a few lookups per request
    whatever the history's length."""

    plans_first = False

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, history: list[int], k: int) -> list[int]:
        """One history on its own (an index made for it and dropped)."""
        return _NgramIndex(self.min_n, self.max_n).propose(history, k)

    def propose_many(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        out = []
        for attempt, history, k in requests:
            index = self._indexes.get(attempt)
            if index is None:
                index = self._indexes[attempt] = _NgramIndex(self.min_n, self.max_n)
            out.append(index.propose(history, k))
        return out

    def forget(self, attempt: str) -> None:
        self._indexes.pop(attempt, None)


class _NgramIndex:
    """n-gram -> the position right after its latest occurrence, for the n-grams that
    end before the history's last position (each has a token after it)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self.after: dict[tuple[int, ...], int] = {}
        self.history: list[int] = []

    def propose(self, history: list[int], k: int) -> list[int]:
        if history[:len(self.history)] != self.history:  # not a continuation: start over
            self.after.clear()
            self.history = []
        for end in range(max(len(self.history), 1), len(history)):
            for n in self.sizes:
                if end >= n:
                    self.after[tuple(history[end - n:end])] = end
        self.history = list(history)
        if k <= 0:
            return []
        for n in self.sizes:
            if len(history) > n:
                at = self.after.get(tuple(history[-n:]))
                if at is not None:
                    return history[at:at + k]
        return []


@dataclass
class StepCosts:
    """Measured decode step times by rows computed (an exponential average per count),
    and the cost of a count not measured yet, interpolated or extrapolated linearly."""

    decay: float = 0.9
    times: dict[int, float] = field(default_factory=dict)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.times.get(rows)
        self.times[rows] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def estimate(self, rows: int) -> float | None:
        if rows in self.times:
            return self.times[rows]
        known = sorted(self.times)
        if len(known) < 2:
            return None
        lower = [n for n in known if n < rows]
        upper = [n for n in known if n > rows]
        a, b = (lower[-1], upper[0]) if lower and upper else \
            ((known[-2], known[-1]) if lower else (known[0], known[1]))
        ta, tb = self.times[a], self.times[b]
        return max(ta + (tb - ta) * (rows - a) / (b - a), 1e-6)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step emits for a draft of ``k`` whose tokens are each accepted with
    probability ``rate`` until the first rejection: the accepted ones plus one."""
    return 1.0 + sum(rate ** j for j in range(1, k + 1))


@dataclass
class SpecMetrics:
    """vLLM's counters: drafts, drafted and accepted tokens, acceptance by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1


class Speculator:
    """Drafts for an engine's running sequences, verified after each decode step."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int,
                 max_model_len: int, adaptive: bool = True) -> None:
        self.adaptive = adaptive
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.costs = StepCosts()
        self.metrics = SpecMetrics()
        self._rates: dict[str, float] = {}
        self._steps = 0
        self._step_started = 0.0
        self._propose_s = 0.0
        self._step_ended: float | None = None
        self.overhead_s: float | None = None

    def propose(self, running: list[Sequence],
                fit: Callable[[Sequence, list[int]], list[int]] | None = None
                ) -> list[tuple[Sequence, list[int]]]:
        """Drafts for the running sequences where they pay (module docstring, 1), each
        with its sequence (the scheduler sets them: ``Scheduler.set_drafts``).
        ``fit(seq, draft)``: the part of a draft the sequence's grammar accepts."""
        self._steps += 1
        self._propose_s = 0.0
        eligible = [(seq, room) for seq in running if (room := self._room(seq)) > 0]
        if not eligible:
            return []
        started = time.perf_counter()
        if self.proposer.plans_first:  # a model: draft only what will be checked
            lens = self.plan_draft_lens(len(running), [(self._rate(seq), room)
                                                       for seq, room in eligible])
            eligible = [(seq, k) for (seq, _), k in zip(eligible, lens, strict=True) if k]
        drafts = self.proposer.propose_many([(seq.attempt, seq.token_ids, room)
                                             for seq, room in eligible])
        self._propose_s = time.perf_counter() - started
        candidates = [(seq, fit(seq, d) if fit is not None and d else d)
                      for (seq, _), d in zip(eligible, drafts, strict=True)]
        candidates = [(seq, d) for seq, d in candidates if d]
        if not candidates:
            return []
        lens = [len(d) for _, d in candidates] if self.proposer.plans_first else \
            self.plan_draft_lens(len(running), [(self._rate(seq), len(d))
                                                for seq, d in candidates])
        return [(seq, draft[:k]) for (seq, draft), k in zip(candidates, lens, strict=True) if k]

    def _room(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may draft: 0 unless its next step is a plain decode
        row, and never past max_tokens (the last token is never drafted) or the model."""
        if seq.status.is_finished or seq.in_flight or seq.processed + 1 != len(seq):
            return 0
        return min(self.k, seq.sampling.max_tokens - seq.output_len - 1,
                   self.max_model_len - len(seq) - 1)

    def _rate(self, seq: Sequence) -> float:
        return self._rates.get(seq.attempt, ACCEPTANCE_PRIOR)

    def plan_draft_lens(self, rows: int, drafts: list[tuple[float, int]]) -> list[int]:
        """Each candidate's draft length, for a step of ``rows`` decode rows: the common
        cap (0 ..= K) that maximises the expected tokens per second of the step, each
        draft cut to it, by the measured step costs. Until the plain step's cost is
        known, no draft; a cap whose cost cannot be estimated yet is tried once every
        PROBE_EVERY steps, so the costs get measured. Each step also pays the time
        measured between two busy decode steps (``overhead_s``): more tokens a step
        spread it thinner."""
        if not self.adaptive:
            return [n for _, n in drafts]
        base = self.costs.estimate(rows)
        overhead = self.overhead_s or 0.0
        if base is None:
            return [0] * len(drafts)
        best, best_rate, unknown = 0, rows / (base + overhead), None
        for cap in range(1, self.k + 1):
            lens = [min(n, cap) for _, n in drafts]
            cost = self.costs.estimate(rows + sum(lens))
            if cost is None:
                unknown = cap if unknown is None else unknown
                continue
            tokens = rows - len(drafts) + sum(
                expected_tokens(rate, n) for (rate, _), n in zip(drafts, lens, strict=True))
            if tokens / (cost + overhead) > best_rate:
                best, best_rate = cap, tokens / (cost + overhead)
        if unknown is not None and self._steps % PROBE_EVERY == 0:
            best = unknown
        return [min(n, best) for _, n in drafts]

    def step_started(self) -> None:
        now = time.perf_counter()
        if self._step_ended is not None and now - self._step_ended < BUSY_GAP_S:
            # what a step costs besides its model run, whatever its rows: scheduling,
            # reports, the router's round trip; a step that emits more tokens pays it once
            gap = max(now - self._step_ended - self._propose_s, 0.0)  # drafting: in costs
            self.overhead_s = gap if self.overhead_s is None else \
                0.9 * self.overhead_s + 0.1 * gap
        self._step_started = now

    def step_done(self, rows_computed: int) -> None:
        """The step's time, the proposer's included (a draft model's runs), by rows."""
        self._step_ended = time.perf_counter()
        self.costs.observe(rows_computed, self._step_ended - self._step_started
                           + self._propose_s)

    def verify(self, attempt: str, draft: list[int] | tuple[int, ...],
               drawn: list[int]) -> list[int]:
        """The tokens ``attempt`` emits: its drafted tokens while each equals the token
        drawn after the ones before it, then the token drawn after the last accepted
        one. ``drawn``: the token sampled at each of the row's 1 + len(draft) positions."""
        accepted = 0
        while accepted < len(draft) and draft[accepted] == drawn[accepted]:
            accepted += 1
        self.metrics.record(len(draft), accepted)
        # per-token acceptance, as a run of accepts ended by a rejection estimates it
        rate = accepted / (accepted + (accepted < len(draft))) if draft else ACCEPTANCE_PRIOR
        old = self._rates.get(attempt, ACCEPTANCE_PRIOR)
        self._rates[attempt] = ACCEPTANCE_DECAY * old + (1 - ACCEPTANCE_DECAY) * rate
        return [*draft[:accepted], drawn[accepted]]

    def fold(self, scheduled: list, spans: list[tuple[int, int]], tokens: list,
             logprobs: list | None) -> tuple[list, list | None]:
        """A drafted step's runner results back to its scheduled rows: each row's token,
        or the list of tokens a drafted row emits (``verify``); and each row's list of
        logprobs (those of its emitted tokens), when the step computed any."""
        out_tokens: list = []
        out_logprobs: list | None = [] if logprobs is not None else None
        for row, (first, count) in zip(scheduled, spans, strict=True):
            drawn = tokens[first:first + count]
            emitted = self.verify(row.attempt, row.draft, drawn) if count > 1 else drawn
            out_tokens.append(emitted if count > 1 else drawn[0])
            if out_logprobs is not None:
                lps = logprobs[first:first + len(emitted)]
                out_logprobs.append(lps if lps and lps[0] is not None else None)
        return out_tokens, out_logprobs

    def forget(self, attempt: str) -> None:
        self._rates.pop(attempt, None)
        self.proposer.forget(attempt)


def make_speculator(config, runner, max_model_len: int) -> Speculator | None:
    """The engine's speculator for its settings (None: "off", or a prefill engine,
    which never decodes). ValueError where it cannot run: each drafted position is a
    row of the C decode step, and a sliding-window ring would lose positions a
    rejected draft overwrote."""
    if config.speculative == "off" or config.type == EngineType.PROMPT:
        return None
    if runner.sliding_window:
        raise ValueError("speculative: a model with sliding-window layers cannot draft "
                         "(a rejected draft would overwrite ring positions still needed)")
    if not runner.decode_kernel:
        raise ValueError("speculative needs the C decode step (decode_kernel, a CPU "
                         "device and a model it supports)")
    if config.speculative == "draft":
        proposer: Proposer = DraftModelProposer(
            resolve_model(config.draft_model).path, runner.vocab_size, config.block_size,
            dtype=config.dtype, device=config.device, kernel_isa=config.kernel_isa,
            quantization=config.quantization)
    else:
        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    return Speculator(proposer, config.num_speculative_tokens, max_model_len,
                      adaptive=config.speculative_adaptive)
