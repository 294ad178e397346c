"""One disaggregated router for the bench tests, on the session's shared Ray and tiny
model (tests/conftest.py)."""

from __future__ import annotations

import pytest

# Small enough to start fast, room for the tests' few requests.
ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 16, "block_size": 16}


@pytest.fixture(scope="session")
def router_address(ray_session, tiny_model_dir):
    """Address of a disaggregated router (1 prefill + 1 decode rank) for the session."""
    from pdserve.bench.compare_modes import DEPLOYMENTS
    from pdserve.bench.routers import inprocess_router

    with inprocess_router(DEPLOYMENTS["disaggregated"], model=tiny_model_dir,
                          engine=ENGINE) as address:
        yield address
