"""Fixtures every suite shares: one embedded Ray for the whole session, one tiny model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, num_cpus=8,
                 # "scarce": a resource too small for every rank asked of it (scaling tests)
                 resources={"prefill": 8, "decode": 8, "scarce": 2},
                 # short (socket paths) and our own: other suites may run a Ray beside us
                 _temp_dir=f"/tmp/pdr{os.getpid() % 100000}",
                 log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from pdserve.engine.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))
