"""One embedded Ray for the session, the tiny model, and one disaggregated router on a
thread of its own (the minimal bring-up of tests/router/conftest.py, copied so the
two test folders stay independent)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Small enough to start fast, room for the tests' few requests.
ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 16, "block_size": 16}


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():  # same settings as tests/router, whichever starts first
        ray.init(address="local", include_dashboard=False, num_cpus=8,
                 resources={"prefill": 8, "decode": 8}, _temp_dir="/tmp/pdr",
                 log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from pdserve.engine.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def router_address(ray_session, tiny_model_dir):
    """Address of a disaggregated router (1 prefill + 1 decode rank) for the session."""
    from pdserve.bench.compare_modes import DEPLOYMENTS, inprocess_router

    with inprocess_router(DEPLOYMENTS["disaggregated"], model=tiny_model_dir,
                          engine=ENGINE) as address:
        yield address
