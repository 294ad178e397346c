"""GPUs by default (router/gpu_share.py, rank/group_member.py: vote_device): where the
Ray cluster has GPUs and no pool asked for any, `pdserve serve` gives every rank an equal
share, whole GPUs where there are enough; ranks sharing a GPU vote over gloo; a pool
forced onto cuda where it cannot have a GPU is refused with a message naming it."""

from __future__ import annotations

import pytest

from pdserve.rank.group_member import vote_device
from pdserve.router.config import config_from_dict
from pdserve.router.gpu_share import give_pools_gpus


def _config(**pools):
    return config_from_dict({"mode": "disaggregated", **pools})


def test_one_gpu_is_shared_by_a_prefill_and_a_decode_rank():
    config = _config()
    said = give_pools_gpus(config, 1.0)
    assert (config.prefill.num_gpus, config.decode.num_gpus) == (0.5, 0.5)
    assert "0.5 GPU each" in said and "gloo" in said
    assert config.resolved_kv_transport() == "device"  # both pools now hold GPUs
    assert config.prefill.rank_engine_settings("m")["device"] == "cuda"


def test_enough_gpus_give_every_rank_a_whole_one_and_never_more_than_there_are():
    config = _config(prefill={"replicas": 2}, decode={"replicas": 2})
    give_pools_gpus(config, 8.0)
    assert (config.prefill.num_gpus, config.decode.num_gpus) == (1.0, 1.0)
    config = _config(prefill={"replicas": 2}, decode={"replicas": 1})
    give_pools_gpus(config, 2.0)
    share = config.prefill.num_gpus
    assert share == config.decode.num_gpus and 3 * share <= 2.0 and share > 0.66


def test_no_gpus_or_a_users_placement_changes_nothing():
    config = _config()
    assert give_pools_gpus(config, 0.0) is None
    assert config.prefill.rank_engine_settings("m")["device"] == "cpu"
    config = _config(prefill={"num_gpus": 1})  # the user placed the pools
    assert give_pools_gpus(config, 4.0) is None
    assert (config.prefill.num_gpus, config.decode.num_gpus) == (1, 0)


def test_a_pool_held_on_the_cpu_takes_no_gpu():
    config = _config(decode={"engine": {"device": "cpu"}})
    give_pools_gpus(config, 1.0)
    assert (config.prefill.num_gpus, config.decode.num_gpus) == (1.0, 0.0)
    assert config.decode.rank_engine_settings("m")["device"] == "cpu"
    # placed so, their dtypes (auto) resolve apart: refused before any rank starts
    with pytest.raises(ValueError, match=r"prefill ranks on cuda .* decode ranks on cpu"):
        config.check_kv_dtypes()
    config = _config(prefill={"engine": {"dtype": "float32"}},
                     decode={"engine": {"device": "cpu", "dtype": "float32"}})
    give_pools_gpus(config, 1.0)
    config.check_kv_dtypes()  # one dtype on both: the hand-offs fit


def test_normal_mode_shares_the_gpus_among_its_ranks():
    config = config_from_dict({"mode": "normal", "normal": {"replicas": 3}})
    give_pools_gpus(config, 1.0)
    assert 0.33 <= config.normal.num_gpus <= 1 / 3


def test_cuda_forced_without_a_gpu_is_refused_by_name():
    config = _config(prefill={"engine": {"device": "cuda"}})
    with pytest.raises(ValueError, match=r"prefill\.engine\.device cuda, but the Ray cluster "
                                         r"has no GPU"):
        give_pools_gpus(config, 0.0)
    config = _config(prefill={"num_gpus": 1}, decode={"engine": {"device": "cuda"}})
    with pytest.raises(ValueError, match=r"decode\.engine\.device cuda, but decode num_gpus is 0"):
        give_pools_gpus(config, 2.0)


def test_ranks_holding_a_fraction_of_a_gpu_vote_over_gloo():
    assert vote_device("cuda:0", 0.5) == "cpu"  # NCCL refuses two ranks on one GPU
    assert vote_device("cuda:0", 1.0) == "cuda:0"
    assert vote_device("cuda:1", 2.0) == "cuda:1"
    assert vote_device("cpu", 0.0) == "cpu"


def test_serve_takes_device_and_checks_it(tiny_model_dir):
    from pdserve.cli import build_parser
    from pdserve.router.serve_command import serve_config

    args = build_parser().parse_args(["serve", "--model", tiny_model_dir, "--device", "cpu",
                                      "--num-gpus", "0.5"])
    config = serve_config(args)
    assert {p.engine.device for p in config.pools()} == {"cpu"}
    assert config.prefill.num_gpus == 0.5
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args(["serve", "--device", "tpu"])
