import pytest

from pdserve.simulator.cost_model import CostModel, DecodeStepCost, HandoffCost, PromptStepCost


@pytest.fixture
def costs() -> CostModel:
    """Round numbers, so expected times can be worked out by hand."""
    return CostModel(PromptStepCost(0.002, 2e-5, 0.0, 0.0), DecodeStepCost(0.004, 1e-4, 0.0),
                     HandoffCost(0.003, 0.0), kv_bytes_per_token=4096, max_model_len=2048)
