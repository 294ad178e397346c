"""How many torch threads a rank's steps may run on (PoolConfig.threads): a rank of any
pool takes its share of its node's cores among its pool's ranks ("auto"), so that a
decode rank's steps can borrow an idle prefill rank's cores and a prompt step runs on
the prefill rank's; a number is taken as given."""

from __future__ import annotations

import asyncio
import os

import pytest

from pdserve.rank.engine_rank import rank_threads
from pdserve.router.config import PoolConfig, RouterConfig, load_config


@pytest.mark.parametrize(("setting", "pool_size", "cores", "expected"), [
    ("auto", 1, 2, 2),  # 1P+1D on two cores: each rank may take both
    ("auto", 2, 2, 1),
    ("auto", 3, 16, 5),
    ("auto", 4, 2, 1),  # more ranks than cores: still one each
    ("auto", 0, 8, 8),  # a pool scaled to 0 and back starts its first rank
    ("auto", 1, 16, 16),  # a prompt step on every core it has
    (3, 1, 2, 3),
    (2, 1, 2, 2),
])
def test_rank_threads(setting, pool_size, cores, expected):
    assert rank_threads(setting, pool_size, cores) == expected  # one rule for every pool


@pytest.mark.parametrize("bad", [0, -1, True, "many", 1.5, None])
def test_bad_threads_are_refused_naming_the_pool_and_field(bad):
    config = RouterConfig(model_dir="", decode=PoolConfig("decode", threads=bad))
    with pytest.raises(ValueError, match=r"decode threads must be an integer >= 1 or \"auto\""):
        config.validate()


def test_threads_from_yaml(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("decode:\n  threads: 3\nprefill:\n  replicas: 2\n")
    config = load_config(path)
    assert config.decode.threads == 3
    assert config.prefill.threads == "auto" and config.prefill.replicas == 2


def test_started_ranks_say_their_threads(ray_session, tiny_model_dir):
    from pdserve.router.service import RouterService

    engine = dict(num_kv_blocks=64, max_num_seqs=8, block_size=16)
    config = RouterConfig(
        model_dir=tiny_model_dir, port=0, collective_timeout_s=10.0,
        prefill=PoolConfig("prefill", replicas=1, num_cpus=0.5, resources={"prefill": 1},
                           engine=engine),
        decode=PoolConfig("decode", replicas=1, num_cpus=0.5, resources={"decode": 1},
                          engine=engine))
    service = RouterService(config)

    async def start():
        await service.start()
        try:
            return {r.info.pool: r.info.threads for p in service.pools.values() for r in p.ranks}
        finally:
            await service.stop()

    said = asyncio.run(start())
    # the ranks run on this node: each pool's one rank's share of its cores is all of them
    cores = len(os.sched_getaffinity(0))
    assert said == {"prefill": cores, "decode": cores}
