"""The draft-model proposer (speculative: draft) on the tiny model: the target as its own
draft proposes the target's own greedy tokens, so every drafted token is accepted;
outputs equal plain decoding's in both modes, greedy and seeded; the draft's cache keeps
what the target accepted and frees what a request held when it ends."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.speculative.draft_model import DraftModelProposer

PROMPTS = [f"draft {i}: the cat sat on the mat, and then the" for i in range(4)]


def test_the_target_as_its_own_draft_proposes_its_greedy_tokens(tiny_model_dir):
    llm = LLM(tiny_model_dir)
    [out] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
    prompt = llm.tokenizer.encode(PROMPTS[0])
    draft = DraftModelProposer(tiny_model_dir, llm.engines[0].runner.vocab_size, 16,
                               kv_cache_mb=16)
    assert draft.propose(prompt, 6) == out.token_ids[:6]
    # a later history that keeps the first 3 drafted tokens: the cache keeps them
    drafts = draft.propose_many([("r", prompt, 4)])
    assert drafts == [out.token_ids[:4]]
    history = prompt + out.token_ids[:3]
    assert draft.propose_many([("r", history, 4)]) == [out.token_ids[3:7]]
    assert draft._states["r"].tokens[:len(history)] == history
    free = len(draft._free)
    draft.forget("r")
    assert len(draft._free) > free and not draft._states


@pytest.mark.parametrize("mode", ["normal", "disaggregated"])
def test_outputs_equal_plain_decoding_and_every_draft_is_accepted(tiny_model_dir, mode):
    off = LLM(tiny_model_dir, mode=mode)
    # the cost model would rarely let a draft as large as its target pay: draft always
    on = LLM(tiny_model_dir, mode=mode, speculative="draft", draft_model=tiny_model_dir,
             num_speculative_tokens=4, speculative_adaptive=False)
    m = on.engines[-1].speculator.metrics
    for sp in (SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
               SamplingParams(max_tokens=30, temperature=0.9, seed=4, ignore_eos=True)):
        want = off.generate(PROMPTS, sp, use_tqdm=False)
        got = on.generate(PROMPTS, sp, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        if sp.greedy:  # its own greedy tokens: every drafted token accepted
            assert m.num_drafts > 10 and m.num_accepted_tokens == m.num_draft_tokens
    on.assert_drained()
    assert not on.engines[-1].speculator.proposer._states  # every draft block went back


def test_draft_settings_are_checked():
    from pdserve.engine.config import EngineSettings

    with pytest.raises(ValueError, match="draft_model"):
        EngineSettings(speculative="draft")
    with pytest.raises(ValueError, match="draft_model"):
        EngineSettings(speculative="ngram", draft_model="tiny")
