"""The logits controls of a request's ``SamplingParams``, applied to the rows that have
any, before temperature, min-p, top-k and top-p (``kernels/sampling.py``).

Order and semantics are vLLM's (v1 sampler): the grammar's token bitmask first, then
the bad words, ``min_tokens`` and ``logit_bias``, then the penalties (repetition over
the prompt and the answer, then frequency and presence over the answer). A guided row
that these leave without any allowed token falls back to its grammar's mask alone:
the grammar wins over ``min_tokens``, bias and bad words, so a structure can always end.

Rows without controls pay nothing: ``apply_controls`` returns the logits it was given
when no row has any. Otherwise it returns a copy (the raw logits stay for logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.scheduler.sampling_params import SamplingParams


@dataclass
class RowControls:
    """What one row's controls read: its sequence's tokens (the live list, read up to
    ``length``: the drawn token goes at ``length``), where its answer starts, the ids
    ``min_tokens`` holds back (EOS and the stop ids) and, when guided, its matcher."""

    history: list[int]
    length: int
    answer_start: int
    stop_ids: tuple[int, ...] = ()
    matcher: Any = None

    @property
    def answer(self) -> list[int]:
        return self.history[self.answer_start:self.length]


def apply_controls(logits: torch.Tensor, sampling: list[SamplingParams],
                   controls: list[RowControls | None]) -> torch.Tensor:
    """``logits`` [R, V] fp32 with each row's controls applied (a copy), or ``logits``
    itself when no row has any."""
    rows = [i for i, c in enumerate(controls) if c is not None]
    if not rows:
        return logits
    out = logits.clone()
    guided = [i for i in rows if controls[i].matcher is not None]
    bitmask = _grammar_masks(out, controls, guided) if guided else None
    for i in rows:
        _apply_row(out[i], sampling[i], controls[i])
    if guided:
        stuck = [i for i in guided if not bool(torch.isfinite(out[i]).any())]
        if stuck:  # the grammar wins: its mask alone
            _apply_bitmask(logits, out, bitmask, stuck)
    return out


def _grammar_masks(out: torch.Tensor, controls: list[RowControls | None],
                   guided: list[int]) -> torch.Tensor:
    # lazy: xgrammar is optional (the grammar extra) and heavy; only guided rows need it
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(out.shape[0], out.shape[1])
    for i in guided:
        controls[i].matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(out, bitmask, indices=guided)
    return bitmask


def _apply_bitmask(raw: torch.Tensor, out: torch.Tensor, bitmask: torch.Tensor,
                   rows: list[int]) -> None:
    # lazy: xgrammar is optional (the grammar extra) and heavy; only guided rows need it
    import xgrammar as xgr

    out[rows] = raw[rows]
    xgr.apply_token_bitmask_inplace(out, bitmask, indices=rows)


def _apply_row(x: torch.Tensor, sp: SamplingParams, c: RowControls) -> None:
    """One row's bad words, min_tokens, bias and penalties, in place on ``x`` [V]."""
    vocab = x.shape[0]
    answer = c.answer
    if sp.bad_words_token_ids:
        x[[t for t in _bad_word_ends(sp.bad_words_token_ids, answer) if t < vocab]] = \
            float("-inf")
    if len(answer) < sp.min_tokens:
        stops = [t for t in c.stop_ids if 0 <= t < vocab]
        x[stops] = float("-inf")
    if sp.logit_bias:
        ids = torch.tensor([t for t, _ in sp.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in sp.logit_bias if t < vocab], dtype=x.dtype)
        x.index_add_(0, ids, bias)
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(c.history[:c.length], dtype=torch.long).unique()
        vals = x[seen]
        x[seen] = torch.where(vals > 0, vals / sp.repetition_penalty,
                              vals * sp.repetition_penalty)
    if (sp.frequency_penalty or sp.presence_penalty) and answer:
        counts = torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(x.dtype)
        x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(x.dtype)


def _bad_word_ends(words: tuple[tuple[int, ...], ...], answer: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the answer (a one-token
    word: always), as vLLM refuses them."""
    ends = []
    for word in words:
        prefix = word[:-1]
        if len(prefix) > len(answer):
            continue
        if not prefix or tuple(answer[-len(prefix):]) == prefix:
            ends.append(word[-1])
    return ends
