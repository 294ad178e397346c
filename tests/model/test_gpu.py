"""The same equivalence on CUDA (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
def test_cuda_greedy_matches_transformers(tiny_dirs, h, variant):
    path = tiny_dirs[variant]
    prompts = h.prompts_of([3, 17, 40, 150])
    want = [h.hf_greedy(path, p, 12) for p in prompts]  # transformers on CPU, fp32
    runner = ModelRunner(path, device="cuda", num_kv_blocks=128, num_state_slots=8)
    assert runner.kv_cache.k_blocks[0] is None or runner.kv_cache.device.type == "cuda"
    assert h.drive(runner, prompts, 12, budget=50) == want


def test_cuda_bf16_runs(tiny_dirs, h):
    from pdserve.engine.model_runner import RunnerRow

    runner = ModelRunner(tiny_dirs["llama"], device="cuda", dtype="bfloat16", num_kv_blocks=8)
    (p,) = h.prompts_of([40])
    assert torch.isfinite(runner.compute_logits([RunnerRow(p, 0, [1, 2, 3], 0)])).all()
