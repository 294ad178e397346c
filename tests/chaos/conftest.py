"""The chaos suite's routers: one per KV transport, 2 prefill + 2 decode ranks, with
injected step faults, shared by every chaos module."""

from __future__ import annotations

import pytest

from pdserve.bench import chaos


@pytest.fixture(scope="package")
def reference(tiny_model_dir):
    return chaos.Reference(tiny_model_dir)


@pytest.fixture(scope="package", params=["ray", "grpc"])
def chaos_router(request, ray_session, tiny_model_dir):
    from pdserve.bench.harness import RouterHarness

    harness = RouterHarness(chaos.chaos_router_config(tiny_model_dir, request.param))
    harness.transport = request.param
    harness.sizes = {name: pool.target for name, pool in harness.service.pools.items()}
    yield harness
    harness.close()
