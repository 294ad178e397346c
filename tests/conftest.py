"""Fixtures every suite shares: one embedded Ray for the whole session, one tiny model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_module():
    """load(path): a script of the repository (``scripts/...``, ``protos/generate.py``),
    which no package holds, imported from its file."""
    def load(path: str):
        spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # 12: routers of several modules live together (the real-model router for the
        # whole session among them); a rank asks for 0.5
        ray.init(address="local", include_dashboard=False, num_cpus=12,
                 # "scarce": a resource too small for every rank asked of it (scaling tests)
                 resources={"prefill": 12, "decode": 12, "scarce": 2},
                 # short (socket paths) and our own: other suites may run a Ray beside us
                 _temp_dir=f"/tmp/pdr{os.getpid() % 100000}",
                 log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from pdserve.engine.model.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


# ---- the real model (SmolLM2-135M-Instruct, installed by `make setup`) ------------------

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Name the planets of the solar system in order.",
    "What does HTTP stand for?",
    "Summarize the story of Little Red Riding Hood.",
    "How do I boil an egg?",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a friendly robot.",
    "What causes the seasons on Earth?",
    "Write a short thank-you note to a teacher.",
]


@pytest.fixture(scope="session")
def real_model_path() -> str:
    """The default model's GGUF file (from its registry package; `make setup` installs it)."""
    from pdserve.engine.model.catalog import DEFAULT_MODEL, packaged_model_path

    return str(packaged_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def chat_questions() -> list[str]:
    return list(CHAT_QUESTIONS)


@pytest.fixture(scope="session")
def real_chat_prompts(real_model_path) -> list[list[int]]:
    """CHAT_QUESTIONS rendered by the model's chat template, as token ids."""
    from pdserve.engine.model.tokenizer import Tokenizer
    from pdserve.router.chat_template import ChatTemplate

    template = ChatTemplate.from_model_dir(real_model_path)
    tokenizer = Tokenizer.from_model(real_model_path)
    return [template.encode(tokenizer, template.render([{"role": "user", "content": q}]))
            for q in CHAT_QUESTIONS]


@pytest.fixture(scope="session")
def hf_real_model(real_model_path):
    """transformers' own load of the same GGUF (dequantized, fp32): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(real_model_path)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def real_greedy_check(hf_real_model):
    """check(prompt_ids, generated_ids): every generated token is transformers' argmax
    under teacher forcing, or within NEAR_TIE of it in transformers' own logits (an fp32
    near tie, which the caller is told about). Returns the near ties as (position, ours,
    theirs, gap)."""
    import torch

    near_tie = 1e-4

    def check(prompt_ids: list[int], generated: list[int]) -> list[tuple]:
        ids = torch.tensor([list(prompt_ids) + list(generated)])
        with torch.inference_mode():
            logits = hf_real_model(ids).logits[0, len(prompt_ids) - 1:-1]
        ties = []
        for pos, (row, token) in enumerate(zip(logits, generated, strict=True)):
            best = int(row.argmax())
            if best != token:
                gap = float(row[best] - row[token])
                assert gap <= near_tie, (
                    f"position {pos}: generated {token}, transformers' argmax {best} "
                    f"(logit gap {gap:.3g} > {near_tie})")
                ties.append((pos, token, best, gap))
        return ties

    return check
