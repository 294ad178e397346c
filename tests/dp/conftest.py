"""Real rank processes for the data-parallel tests: one pool of 4, started once."""

from __future__ import annotations

import pytest

from pdserve.engine.rank_pool import RankPool

POOL_SIZE = 4


@pytest.fixture(scope="session")
def rank_pool():
    """Four spawned rank processes sharing a store hosted by the test process.

    Tests run functions on all or some of them (``pool.run(fn, ..., ranks=[0, 1])``)
    and form groups of any size up to four; no test may kill one of these processes
    (the dead-peer tests start their own).
    """
    pool = RankPool(POOL_SIZE)
    yield pool
    pool.close()
