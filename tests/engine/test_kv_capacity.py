"""An engine's KV capacity (what its rank's endpoint bounds payloads by) is what its
cache holds, counted from the cache's own tensors."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
def test_kv_capacity_counts_the_caches_own_tensors(model_dirs, variant):
    engine = LLMEngine(EngineConfig(model_dir=model_dirs[variant], num_kv_blocks=40,
                                    max_num_seqs=4, max_model_len=256, block_size=16))
    cache = engine.runner.kv_cache
    kv = engine.kv_capacity()
    blocks = _nbytes(cache.k_blocks) + _nbytes(cache.v_blocks)
    rings = _nbytes(cache.k_ring) + _nbytes(cache.v_ring)
    assert (kv.num_blocks, kv.block_size, kv.device) == (40, 16, "cpu")
    held = {str(t.dtype).removeprefix("torch.") for t in (*cache.k_blocks, *cache.k_ring)
            if t is not None}
    assert held == {kv.dtype} == {"float32"}
    assert kv.total_bytes == blocks + rings
    assert kv.bytes_per_block * 40 == blocks
    assert kv.max_tokens == 256  # the model length, under the blocks' 40 * 16
    ring_per_slot = rings // cache.num_state_slots
    assert kv.max_payload_bytes == 16 * kv.bytes_per_block + ring_per_slot
    assert (rings > 0) == (variant == "mistral-swa")
