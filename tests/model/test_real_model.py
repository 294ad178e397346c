"""The real model (SmolLM2-135M-Instruct, its Q4_1 GGUF) against transformers loading the
same file (fp32, dequantized): chat prompts tokenized alike, greedy tokens equal to
transformers' argmax under teacher forcing at every position (an fp32 near tie is shown to
be one, not tolerated blindly) offline in both modes, with the prefix cache warm and with
n > 1 forks; perplexity on a fixed text within 0.5% of transformers'."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

MAX_TOKENS = 64
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def normal_llm(real_model_path):
    return LLM(real_model_path, max_num_seqs=16, activation_precision="fp32")


@pytest.fixture(scope="module")
def normal_outputs(normal_llm, real_chat_prompts):
    outs = normal_llm.generate(prompt_token_ids=real_chat_prompts, sampling_params=GREEDY,
                               use_tqdm=False)
    normal_llm.assert_drained()
    return [o.token_ids for o in outs]


def test_chat_prompt_tokens_equal_transformers(real_model_path, chat_questions,
                                               real_chat_prompts):
    """Our tokenizer (transformers' GGUF converter + SmolLM's digit split) and template
    give the ids transformers' own GGUF tokenizer and apply_chat_template give."""
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(real_model_path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for question, ours in zip(chat_questions, real_chat_prompts, strict=True):
        theirs = hf.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, return_dict=False)
        assert ours == list(theirs), question
    assert hf.decode(ours[-4:]) == "<|im_start|>assistant\n"  # the generation prompt


def _check_all(check, prompts, outputs) -> int:
    ties = 0
    for prompt, generated in zip(prompts, outputs, strict=True):
        assert len(generated) == MAX_TOKENS
        ties += len(check(prompt, generated))
    return ties


def test_normal_greedy_equals_transformers(real_greedy_check, real_chat_prompts, normal_outputs):
    ties = _check_all(real_greedy_check, real_chat_prompts, normal_outputs)
    assert ties <= 4  # near ties are rare: many would mean a systematic difference


def test_disaggregated_greedy_equals_transformers(real_model_path, real_greedy_check,
                                                  real_chat_prompts, normal_outputs):
    llm = LLM(real_model_path, mode="disaggregated", max_num_seqs=16, activation_precision="fp32",
              max_num_batched_tokens=64)  # chunked prompts, then the KV hand-off
    outs = llm.generate(prompt_token_ids=real_chat_prompts, sampling_params=GREEDY,
                        use_tqdm=False)
    llm.assert_drained()
    tokens = [o.token_ids for o in outs]
    _check_all(real_greedy_check, real_chat_prompts, tokens)
    assert sum(a == b for a, b in zip(tokens, normal_outputs, strict=True)) >= 14


def test_warm_prefix_cache_gives_the_same_tokens(normal_llm, real_chat_prompts,
                                                 normal_outputs):
    outs = normal_llm.generate(prompt_token_ids=real_chat_prompts, sampling_params=GREEDY,
                               use_tqdm=False)
    normal_llm.assert_drained()
    assert [o.token_ids for o in outs] == normal_outputs
    # the system prompt every chat shares is a cached prefix (blocks of 16 tokens)
    assert all(o.num_cached_tokens >= 16 for o in outs)


def test_forks_give_the_greedy_tokens(real_model_path, real_chat_prompts, normal_outputs):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=real_model_path, engine_type="normal",
                                    max_num_seqs=16, activation_precision="fp32"))
    for i in (0, 5):
        engine.add_request(f"r{i}", real_chat_prompts[i], GREEDY,
                           forks=[(f"r{i}-fork{k}", GREEDY) for k in (1, 2)])
    tokens: dict[str, list[int]] = {}
    for _ in range(1000):
        if not engine.has_work():
            break
        for out in engine.step().outputs:
            tokens.setdefault(out.attempt, []).extend(out.new_token_ids)
    engine.assert_drained()
    for i in (0, 5):
        for rid in (f"r{i}", f"r{i}-fork1", f"r{i}-fork2"):
            assert tokens[rid] == normal_outputs[i], rid


def test_perplexity_within_half_a_percent_of_transformers(real_model_path, hf_real_model):
    from pdserve.bench import perplexity
    from pdserve.engine.model.tokenizer import Tokenizer

    ids = Tokenizer.from_model(real_model_path).encode(perplexity.reference_text(),
                                                       add_special_tokens=False)
    token_chunks = perplexity.chunks(ids, 512, 4)
    exact = perplexity.pdserve_runner(real_model_path, token_chunks, activation_precision="fp32")
    ours = perplexity.pdserve_perplexity(real_model_path, token_chunks, runner=exact)
    theirs = perplexity.transformers_perplexity(hf_real_model, token_chunks)
    assert 5 < theirs < 30  # an English text, a small model: a sane figure
    assert abs(ours / theirs - 1) < 0.005, (ours, theirs)

