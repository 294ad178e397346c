import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    from pdserve.engine.model.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("engine-models")
    return {variant: str(make_tiny_model(root / variant, variant=variant))
            for variant in ("llama", "mistral-swa")}


@pytest.fixture(scope="session")
def hf_greedy():
    """transformers' own greedy generate, one prompt at a time (no padding involved)."""
    import torch
    from transformers import AutoModelForCausalLM

    cache = {}

    def generate(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        if model_dir not in cache:
            cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model = cache[model_dir]
        outs = []
        with torch.inference_mode():
            for ids in prompts:
                x = torch.tensor([ids])
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
                outs.append(y[0, len(ids):].tolist())
        return outs

    return generate


@pytest.fixture(scope="session")
def mixed_prompts():
    """Prompts of mixed lengths (1 to 100 tokens) drawn from a fixed seed."""
    import random

    rng = random.Random(1)
    lengths = [3, 17, 40, 70, 9, 33, 100, 1]
    return [[rng.randrange(3, 4096) for _ in range(length)] for length in lengths]
