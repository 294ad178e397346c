"""The logits controls against vLLM's definitions, on logits computed by hand: the
expected values below are written out from the definitions, not produced by the code.

vLLM (v1 sampler, ``apply_penalties`` / ``apply_bad_words`` / the min_tokens and
logit_bias processors, ``apply_min_p``):
- repetition_penalty r, for tokens in the prompt or the answer: x / r if x > 0 else x * r;
- frequency_penalty f: x - f * count(token in the answer);
- presence_penalty p: x - p * (token in the answer);
- logit_bias: x + bias; min_tokens: EOS and stop ids -inf while the answer is shorter;
- bad words: the last token of a word -inf where the answer ends with its other tokens;
- min_p: after temperature, tokens with probability < min_p * max probability dropped.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.logits_controls import RowControls, apply_controls
from pdserve.kernels.sampling import apply_min_p, sample
from pdserve.scheduler.sampling_params import Guide, SamplingParams

INF = float("inf")


def _one(x: list[float], sp: SamplingParams, history: list[int], answer_start: int,
         stop_ids=(0,)) -> list[float]:
    logits = torch.tensor([x], dtype=torch.float32)
    c = RowControls(history, len(history), answer_start, tuple(stop_ids))
    return apply_controls(logits, [sp], [c])[0].tolist()


def test_no_controls_returns_the_same_tensor():
    logits = torch.randn(3, 8)
    assert apply_controls(logits, [SamplingParams()] * 3, [None] * 3) is logits


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # prompt [1, 2], answer [3]; token 4 never seen
    out = _one([0.0, 2.0, -1.0, 3.0, 5.0], SamplingParams(repetition_penalty=2.0),
               history=[1, 2, 3], answer_start=2)
    assert out == [0.0, 1.0, -2.0, 1.5, 5.0]


def test_frequency_and_presence_penalties_count_the_answer_only():
    # prompt [1, 1], answer [2, 2, 3]: token 1 (prompt only) is untouched
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = _one([1.0, 1.0, 1.0, 1.0], sp, history=[1, 1, 2, 2, 3], answer_start=2)
    assert out == pytest.approx([1.0, 1.0, 1.0 - 2 * 0.5 - 0.25, 1.0 - 0.5 - 0.25])


def test_prior_output_tokens_move_the_answer_start():
    """A moved request's answer so far sits at the end of its prompt: the penalties
    count it as the answer, as they did before the move."""
    sp = SamplingParams(frequency_penalty=1.0, prior_output_tokens=2)
    from pdserve.engine.guided.requests import answer_start
    from pdserve.scheduler.sequence import Sequence

    seq = Sequence("r", [5, 6, 2, 2], sp)  # original prompt [5, 6], answer [2, 2]
    assert answer_start(seq) == 2
    out = _one([0.0, 0.0, 0.0], sp, history=[1, 0, 2, 2], answer_start=answer_start(seq))
    assert out == [0.0, 0.0, -2.0]


def test_logit_bias_adds_and_min_tokens_holds_back_eos_and_stop_ids():
    sp = SamplingParams(logit_bias={1: 3.0, 2: -100.0}, min_tokens=2, stop_token_ids=[3],
                        max_tokens=4)
    out = _one([1.0, 1.0, 1.0, 1.0, 1.0], sp, history=[4, 4], answer_start=1, stop_ids=(0, 3))
    assert out == [-INF, 4.0, -99.0, -INF, 1.0]
    # the answer has min_tokens tokens: EOS and the stop ids are back
    out = _one([1.0, 1.0, 1.0, 1.0, 1.0], sp, history=[4, 4, 4], answer_start=1,
               stop_ids=(0, 3))
    assert out == [1.0, 4.0, -99.0, 1.0, 1.0]


def test_bad_words_refuse_the_last_token_after_their_prefix():
    sp = SamplingParams(bad_words_token_ids=[[4], [1, 2, 3]])
    # one-token word: always; three-token word: only after [1, 2] ends the answer
    assert _one([0.0] * 5, sp, history=[9 % 5, 1, 2], answer_start=1) == \
        [0.0, 0.0, 0.0, -INF, -INF]
    assert _one([0.0] * 5, sp, history=[0, 2, 1], answer_start=1) == \
        [0.0, 0.0, 0.0, 0.0, -INF]
    # the prefix must lie in the answer, not the prompt
    assert _one([0.0] * 5, sp, history=[1, 2], answer_start=2) == \
        [0.0, 0.0, 0.0, 0.0, -INF]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    # probabilities 0.5, 0.25, 0.125, 0.125: min_p 0.3 keeps those >= 0.15
    x = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    out = apply_min_p(x, torch.tensor([0.3]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(apply_min_p(x, torch.tensor([0.0]))[0]).all()
    # sampled rows only draw what min_p keeps
    drawn = {int(sample(x.repeat(64, 1), torch.ones(64), torch.full((64,), -1),
                        torch.ones(64), torch.arange(64), torch.zeros(64, dtype=torch.long),
                        min_p=torch.full((64,), 0.3))[i]) for i in range(64)}
    assert drawn <= {0, 1} and len(drawn) == 2


def test_penalties_validated():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                dict(repetition_penalty=0.0), dict(min_p=1.5), dict(min_tokens=-1),
                dict(logit_bias={1: 101.0}), dict(min_tokens=20, max_tokens=4),
                dict(bad_words_token_ids=[[]]), dict(ignore_eos=True, guide=Guide("json", "{}"))):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_token_ids")[0]):
            SamplingParams(**bad)


class _RefuseAllButTwo:
    """A stand-in matcher (a test double) allowing tokens 2 and 3 only."""

    def fill_next_token_bitmask(self, bitmask, index):
        bitmask[index] = 0
        bitmask[index, 0] = (1 << 2) | (1 << 3)


def test_grammar_mask_applies_first_and_wins_when_nothing_else_is_left():
    pytest.importorskip("xgrammar")
    logits = torch.zeros(2, 40)
    sp = SamplingParams(logit_bias={2: 5.0})
    c = RowControls([1], 1, 1, (3,), matcher=_RefuseAllButTwo())
    out = apply_controls(logits, [sp, SamplingParams()], [c, None])
    assert out[0, 2] == 5.0 and out[0, 3] == 0.0
    assert not torch.isfinite(out[0, [0, 1, *range(4, 40)]]).any()
    assert torch.equal(out[1], logits[1])  # the unguided row is untouched
    # bad words refuse 2 and min_tokens refuses 3 (EOS): the grammar's mask alone
    sp = SamplingParams(bad_words_token_ids=[[2]], min_tokens=5, max_tokens=8)
    out = apply_controls(logits[:1], [sp], [c])
    assert out[0, 2] == 0.0 and out[0, 3] == 0.0
    assert math.isinf(out[0, 0])
