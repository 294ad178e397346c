"""A draft model: a smaller model with the target's tokenizer proposes the next tokens
(``speculative: draft``), with a paged KV cache of its own on the decode rank.

1. ``propose_many`` gets the candidates of a step (each request's history and how many
   tokens it may draft). For each, the draft's cache is brought up to the history: the
   longest start of the history its cache already holds is kept (what it drafted last
   step and the target accepted included), the rest computed in one row with the first
   drafted token drawn after it; then one decode step per further drafted token, all
   candidates in each (greedy: the draft's most likely token).
2. The KV of drafted positions the target rejects is simply not kept: the next
   ``propose_many`` finds where the history parted from what the cache holds.
3. A request the cache has no room for gets no draft this step; ``forget`` frees a
   finished request's blocks. Nothing crosses ranks: a request imported or moved to a
   decode rank is computed into its draft cache on its first draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step_inputs import RunnerRow
from pdserve.scheduler.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)
DRAFT_CACHE_MB = 128  # the draft's KV cache


@dataclass
class _DraftState:
    tokens: list[int] = field(default_factory=list)  # what its KV holds, by position
    table: list[int] = field(default_factory=list)


class DraftModelProposer:
    plans_first = True  # a model run: the speculator plans draft sizes before it drafts

    def __init__(self, model_dir: str, target_vocab_size: int, block_size: int,
                 kv_cache_mb: int = DRAFT_CACHE_MB, **runner_settings) -> None:
        self.runner = ModelRunner(model_dir, block_size=block_size,
                                  kv_cache_bytes=kv_cache_mb << 20, num_state_slots=0,
                                  **runner_settings)
        if self.runner.sliding_window:
            raise ValueError("draft_model: a model with sliding-window layers cannot draft")
        if self.runner.vocab_size != target_vocab_size:
            raise ValueError(f"draft_model: its vocabulary has {self.runner.vocab_size} "
                             f"tokens, the target's {target_vocab_size}: they must share "
                             "the tokenizer")
        self.block_size = block_size
        self._free = list(range(self.runner.num_kv_blocks - 1, 0, -1))  # block 0 reserved
        self._states: dict[str, _DraftState] = {}

    def propose(self, history: list[int], k: int) -> list[int]:
        """One history on its own (no cache kept between calls)."""
        drafts = self.propose_many([("_one", history, k)])
        self.forget("_one")
        return drafts[0]

    def propose_many(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """Up to k drafted tokens for each (attempt, history, k)."""
        live = [(i, rid, hist, k) for i, (rid, hist, k) in enumerate(requests)
                if k > 0 and self._make_room(rid, hist, len(hist) + k)]
        drafts: list[list[int]] = [[] for _ in requests]
        if not live:
            return drafts
        rows = []
        for _, rid, hist, _ in live:
            state = self._states[rid]
            start = len(state.tokens)
            rows.append(RunnerRow(hist[start:], start, state.table, sampling=_GREEDY,
                                  output_index=len(hist)))
            state.tokens = list(hist)
        tokens = self.runner.execute(rows)
        for (i, _, _, _), token in zip(live, tokens, strict=True):
            drafts[i].append(int(token))
        for step in range(1, max(k for *_, k in live)):
            going = [(i, rid, hist) for i, rid, hist, k in live if k > step]
            rows = [RunnerRow([drafts[i][-1]], len(hist) + step - 1, self._states[rid].table,
                              sampling=_GREEDY, output_index=len(hist) + step)
                    for i, rid, hist in going]
            for (i, rid, _), token in zip(going, self.runner.execute(rows), strict=True):
                self._states[rid].tokens.append(drafts[i][-1])
                drafts[i].append(int(token))
        return drafts

    def _make_room(self, attempt: str, history: list[int], positions: int) -> bool:
        """Keep what the draft's cache holds of ``history`` and give it blocks for
        ``positions``; False (and its state dropped) when the cache is full."""
        state = self._states.setdefault(attempt, _DraftState())
        held = state.tokens
        same = 0
        limit = min(len(held), len(history) - 1)  # the last token is computed again
        while same < limit and held[same] == history[same]:
            same += 1
        del held[same:]
        need = -(-positions // self.block_size) - len(state.table)
        if need > len(self._free):
            self.forget(attempt)
            return False
        state.table += [self._free.pop() for _ in range(max(need, 0))]
        return True

    def forget(self, attempt: str) -> None:
        state = self._states.pop(attempt, None)
        if state is not None:
            self._free += state.table
