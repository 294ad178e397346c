"""An engine's guided requests and the controls of its rows.

1. A guided request (``SamplingParams.guide``) that arrives before its grammar is
   compiled waits here (``park``), out of the scheduler; ``admit_ready`` (each step)
   lets in those whose grammar is ready, so no step waits for a compile.
2. Each row that has controls gets a ``RowControls`` (``controls_for``): the sequence's
   tokens and, when guided, its matcher.
3. A matcher is made when first needed, by replaying the sequence's answer so far: a
   request that was moved (its answer is the end of its prompt), imported from a
   prefill rank (its first token), forked (n > 1) or recomputed after a preemption
   continues where its answer is, with no state carried between ranks.
4. Every token the scheduler appends to a guided sequence goes through ``accept`` (its
   ``token_check``); a refused one ends the request (``structured_output_failed``).
5. ``forget`` drops a matcher when its request ends or is handed off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pdserve.engine.guided.grammar import GrammarBook
from pdserve.engine.logits_controls import RowControls
from pdserve.scheduler.output import ScheduledRow
from pdserve.scheduler.sampling_params import Guide
from pdserve.scheduler.sequence import Sequence

log = logging.getLogger(__name__)

# A grammar evicted from the book's cache while its requests still run is compiled
# again; a matcher made meanwhile waits this long for it.
RECOMPILE_WAIT_S = 30.0


@dataclass
class _Parked:
    attempt: str
    future: Future
    admit: Callable[[], None]
    fail: Callable[[str], None]


class GuidedRequests:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.book = GrammarBook(tokenizer, vocab_size)
        self._eos = tuple(tokenizer.eos_token_ids)
        self._matchers: dict[str, Any] = {}
        self._unmatched: set[str] = set()  # whose answer no matcher could replay
        self._parked: list[_Parked] = []

    # -- waiting for a grammar ---------------------------------------------------------

    def admit_or_park(self, attempt: str, guide: Guide, admit: Callable[[], None],
                      fail: Callable[[str], None]) -> None:
        """Call ``admit`` now if the guide is compiled, else when it is (``fail`` with
        the cause if it cannot be)."""
        future = self.book.request(guide)
        parked = _Parked(attempt, future, admit, fail)
        if future.done():
            self._release(parked)
        else:
            self._parked.append(parked)

    def admit_ready(self) -> None:
        if not self._parked:
            return
        ready, waiting = [], []
        for parked in self._parked:  # one look each: a compile may end meanwhile
            (ready if parked.future.done() else waiting).append(parked)
        self._parked = waiting
        for parked in ready:
            self._release(parked)

    @staticmethod
    def _release(parked: _Parked) -> None:
        exc = parked.future.exception()
        if exc is None:
            parked.admit()
        else:
            log.error("grammar of request %s did not compile: %s", parked.attempt, exc)
            parked.fail(f"its structured-output grammar did not compile: {exc}")

    def unpark(self, attempt: str) -> bool:
        """Drop a request still waiting for its grammar (aborted); True if it was."""
        kept = [p for p in self._parked if p.attempt != attempt]
        found = len(kept) != len(self._parked)
        self._parked = kept
        return found

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    # -- rows and tokens ---------------------------------------------------------------

    def controls_for(self, row: ScheduledRow, length: int,
                     draft: list[int] | tuple = ()) -> RowControls | None:
        """The controls of a scheduled row that draws the token at ``length``, after
        its history and ``draft`` (the drafted tokens before that position, when
        speculating); None when its settings have none."""
        if row.history is None:  # a row carries its history exactly when it has controls
            return None
        sampling = row.sampling
        stops = (*((row.eos_token_id,) if row.eos_token_id is not None else ()),
                 *sampling.stop_token_ids)
        history = list(row.history)
        matcher = None
        if row.guided:
            matcher = self._matcher(row.attempt, sampling.guide, history, answer_start(row),
                                    len(history))
            if matcher is not None and draft:
                matcher = _advanced(matcher, draft)
        return RowControls([*history, *draft], length, answer_start(row), stops, matcher)

    def fitting_draft(self, seq: Sequence, draft: list[int]) -> list[int]:
        """The longest start of ``draft`` that ``seq``'s grammar accepts (all of it for
        an unguided sequence): drafted tokens pass the matcher before they are verified."""
        if seq.so_status != 1 or not draft:
            return draft
        matcher = self._matcher(seq.attempt, seq.sampling.guide, seq.token_ids,
                                answer_start(seq), len(seq.token_ids))
        if matcher is None:
            return []
        probe = matcher.fork()
        for j, token in enumerate(draft):
            if probe.is_terminated() or not probe.accept_token(int(token)):
                return draft[:j]
        return draft

    def accept(self, seq: Sequence, token: int) -> bool:
        """The scheduler's check of a token just appended to a guided sequence."""
        matcher = self._matcher(seq.attempt, seq.sampling.guide, seq.token_ids,
                                answer_start(seq), len(seq.token_ids) - 1)
        if matcher is None:
            return False
        ok = not matcher.is_terminated() and matcher.accept_token(int(token))
        if not ok:
            log.warning("request %s: token %d does not fit its grammar", seq.attempt, token)
        return ok

    def _matcher(self, attempt: str, guide: Guide, history: list[int] | tuple[int, ...], start: int,
                 length: int):
        """``attempt``'s matcher, made by replaying its answer (``history[start:length]``)
        when new; None when that answer does not fit the grammar (then the scheduler's
        check of its next token, ``accept``, fails it: structured_output_failed)."""
        matcher = self._matchers.get(attempt)
        if matcher is not None or attempt in self._unmatched:
            return matcher
        try:
            self.book.request(guide).result(timeout=RECOMPILE_WAIT_S)
            matcher, fits = self.book.matcher(guide, list(history[start:length]))
        except Exception as exc:  # one request's grammar never fails the step
            log.error("request %s: no matcher for its grammar: %s", attempt, exc)
            self._unmatched.add(attempt)
            return None
        if not fits:
            log.warning("request %s: its answer so far does not fit its grammar", attempt)
            self._unmatched.add(attempt)
            return None
        self._matchers[attempt] = matcher
        return matcher

    def forget(self, attempt: str) -> None:
        self._matchers.pop(attempt, None)
        self._unmatched.discard(attempt)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers) + len(self._unmatched)

    def close(self) -> None:
        self.book.close()


def _advanced(matcher, tokens: list[int]):
    """A fork of ``matcher`` that has accepted ``tokens`` (which it accepts: the draft
    was cut to fit, ``fitting_draft``)."""
    fork = matcher.fork()
    for token in tokens:
        fork.accept_token(int(token))
    return fork


def answer_start(seq: Sequence | ScheduledRow) -> int:
    """Where ``seq``'s answer starts: after its prompt, less the answer a moved request
    carries at the end of its prompt (``prior_output_tokens``)."""
    return seq.prompt_len - seq.sampling.prior_output_tokens
