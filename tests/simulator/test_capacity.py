"""The simulator's ranks hold what a real runner holds on the same settings: KV blocks
sized by one rule (engine/config.py: kv_blocks_in) from one default budget, and the
scheduler's state slots (state_slots_for)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.simulator.calibrate import kv_bytes_per_token
from pdserve.simulator.cluster import SimConfig
from pdserve.simulator.cost_model import CostModel

# The floor (MIN_KV_BLOCKS), budgets in between, few sequences with room to spare (the
# runner fills its budget: the simulator once gave only what they could use at full
# length), and the default (the MAX_KV_BLOCKS cap).
SETTINGS = [dict(kv_cache_memory_mb=1), dict(kv_cache_memory_mb=3, max_num_seqs=8),
            dict(kv_cache_memory_mb=7, block_size=32), dict(kv_cache_memory_mb=64, max_num_seqs=4),
            dict()]


def _capacity(model: str, settings: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """(blocks, state slots) of a real runner and of the simulator's prefill rank."""
    runner = ModelRunner.from_engine_config(EngineConfig(model_dir=model, **settings))
    kv_bytes, max_len = kv_bytes_per_token(model, runner.kv_cache.dtype.itemsize)
    costs = dataclasses.replace(CostModel.load(), kv_bytes_per_token=kv_bytes,
                                max_model_len=max_len)
    simulated = SimConfig(engine=settings).scheduler_config("prompt", costs)
    return ((runner.num_kv_blocks, runner.num_state_slots),
            (simulated.num_blocks, simulated.num_state_slots))


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(map(str, s.values())))
def test_the_built_in_models_capacity_is_the_same_in_the_simulator(tiny_model_dir, settings):
    real, simulated = _capacity(tiny_model_dir, settings)
    assert simulated == real


def test_the_real_models_capacity_is_the_same_in_the_simulator(real_model_path):
    real, simulated = _capacity(real_model_path, dict(kv_cache_memory_mb=64))
    assert simulated == real
    assert 16 < real[0] < 8192  # sized by the budget, not by a bound
