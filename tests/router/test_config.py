"""Router config: YAML file + flags, validated, unknown fields refused (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.config import EngineSettings
from pdserve.router.config import config_from_dict, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "router" / "serve.example.yaml"


def test_example_file_loads():
    config = load_config(EXAMPLE)
    assert config.mode == "disaggregated" and config.kv_transport == "auto" and config.kv_streaming
    assert config.resolved_kv_transport() == "ray"  # the example's pools ask for no GPUs
    assert config.prefill.resources == {"prefill": 1}
    assert config.routing == "cache_aware" and config.max_choices == 16
    assert config.decode.engine == EngineSettings(block_size=16, max_num_seqs=64,
                                                  enable_prefix_caching=True, kv_copy_threads=2)
    assert config.prefill.engine == EngineSettings(max_num_seqs=32)


@pytest.mark.parametrize("data, needle", [
    ({"engine": {"kv_copy_threads": 0}}, r"prefill\.engine\.kv_copy_threads must be >= 1"),
    ({"decode": {"engine": {"kv_copy_thread": 2}}}, r"decode\.engine\.kv_copy_thread\b"),
    ({"decode": {"engine": {"max_num_seqs": 0}}}, r"decode\.engine\.max_num_seqs must be"),
    ({"engine": {"hol_bypass_limit": -1}}, r"prefill\.engine\.hol_bypass_limit must be"),
    ({"engine": {"prefill_watermark": 2}}, r"prefill\.engine\.prefill_watermark must be"),
    ({"engine": {"chunked_prefill": "no"}}, r"prefill\.engine\.chunked_prefill must be"),
    ({"engine": 3}, "engine must be a mapping"),
    ({"prefill": {"engine": {"engine_type": "completion"}}}, "engine_type is set by the router"),
    ({"bogus": 1}, "bogus"),
    ({"prefill": {"replica": 2}}, "replica"),
    ({"mode": "both"}, "mode"),
    ({"kv_transport": "nccl"}, "kv_transport"),
    ({"kv_streaming": "yes"}, "kv_streaming"),
    ({"max_queue_depth": 0}, "max_queue_depth"),
    ({"decode": {"replicas": -1}}, "replicas"),
    ({"routing": "random"}, "routing"),
    ({"max_choices": 0}, "max_choices"),
    ({"max_choices": 257}, "max_choices"),
    ({"prefix_overlap_weight": -1}, "prefix_overlap_weight"),
    # the pools' KV layouts must agree, or every hand-off would be refused
    ({"decode": {"engine": {"kv_precision": "fp16"}}},
     r"prefill\.engine\.kv_precision 'auto' and decode\.engine\.kv_precision 'fp16' differ"),
    ({"prefill": {"engine": {"activation_precision": "fp32"}}},
     r"prefill\.engine\.activation_precision 'fp32' and decode\.engine\.activation_precision"),
    ({"decode": {"engine": {"block_size": 32}}}, r"decode\.engine\.block_size 32 differ"),
])
def test_bad_config_names_the_field(data, needle):
    with pytest.raises(ValueError, match=needle):
        config_from_dict(data)


@pytest.mark.parametrize("data, resolved", [
    ({}, "ray"),
    ({"prefill": {"num_gpus": 1}}, "ray"),  # only one pool on GPUs
    ({"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 0.5}}, "device"),
    ({"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 1}, "mode": "normal"}, "ray"),
    ({"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 1}, "kv_transport": "ray"}, "ray"),
    ({"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 1}, "kv_transport": "grpc"}, "grpc"),
    ({"kv_transport": "device"}, "device"),  # on CPU ranks: gloo pair groups
])
def test_kv_transport_auto_is_device_when_both_pools_have_gpus(data, resolved):
    config = config_from_dict(data)
    assert config.kv_transport == data.get("kv_transport", "auto")
    assert config.resolved_kv_transport() == resolved


def test_pools_may_differ_where_the_kv_layout_does_not_depend_on_it():
    """Explicit, equal cache precisions leave the activations free per pool; a normal
    pool has no pair to agree with."""
    both = {"kv_precision": "fp32"}
    config_from_dict({"prefill": {"engine": both | {"activation_precision": "fp32"}},
                      "decode": {"engine": both | {"activation_precision": "int8"}}})
    config_from_dict({"mode": "normal", "decode": {"engine": {"kv_precision": "fp16"}}})


@pytest.mark.parametrize("data, needle", [
    ({"prefill": {"num_gpus": 1}},
     r"prefill ranks on cuda \(prefill\.engine\.dtype 'auto': bfloat16\) and decode ranks on "
     r"cpu \(decode\.engine\.dtype 'auto': float32\) would keep KV caches of different dtypes"),
    ({"decode": {"engine": {"device": "cuda"}}}, r"decode ranks on cuda \(.*: bfloat16\)"),
    ({"decode": {"engine": {"dtype": "bfloat16"}}}, r"decode\.engine\.dtype 'bfloat16': bfloat16"),
])
def test_pools_whose_kv_dtypes_resolve_apart_are_refused_once_placed(data, needle):
    """auto is bf16 on a GPU and fp32 on the CPU: checked once the pools' GPUs are
    decided (serve shares them out after the config is read), before any rank starts."""
    from pdserve.router.service import RouterService

    config = config_from_dict(data)  # a pool's GPUs may still be decided here
    with pytest.raises(ValueError, match=needle):
        config.check_kv_dtypes()
    with pytest.raises(ValueError, match=needle):
        RouterService(config)


def test_pools_whose_kv_dtypes_resolve_alike_start():
    bf16 = {"dtype": "bfloat16"}
    for data in ({}, {"decode": {"engine": {"dtype": "float32"}}},  # auto is fp32 on the CPU
                 {"prefill": {"num_gpus": 1, "engine": bf16}, "decode": {"engine": bf16}},
                 {"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 1}},
                 {"mode": "normal", "normal": {"num_gpus": 1}}):
        config_from_dict(data).check_kv_dtypes()


def test_flags_override_the_file(tiny_model_dir):
    from pdserve.cli import build_parser
    from pdserve.router.serve_command import serve_config

    model = tiny_model_dir  # serve checks the model before anything starts
    args = build_parser().parse_args(
        ["serve", "--config", str(EXAMPLE), "--model", str(model), "--decode", "3",
         "--port", "0", "--kv-transport", "grpc", "--num-kv-blocks", "99",
         "--quantization", "int8", "--kernel-isa", "generic"])
    config = serve_config(args)
    assert config.decode.replicas == 3 and config.prefill.replicas == 1
    assert config.port == 0 and config.kv_transport == "grpc"
    assert config.model_dir == str(model)
    assert config.decode.engine.num_kv_blocks == 99
    assert config.decode.engine.max_num_seqs == 64  # from the file
    assert config.decode.engine.quantization == config.prefill.engine.quantization == "int8"
    assert config.decode.engine.kernel_isa == config.prefill.engine.kernel_isa == "generic"


def test_every_scheduler_policy_is_set_from_yaml():
    """The policies of spec section 9 and the rest of the scheduler's settings: a pool's
    engine: mapping reaches the SchedulerConfig its ranks build (the one default
    elsewhere)."""
    from dataclasses import fields

    from pdserve.engine.config import EngineConfig
    from pdserve.scheduler.config import SchedulerPolicy

    policies = dict(continuation_at_back=True, hol_bypass_limit=3,
                    decode_room_needs_no_block=True, prefill_watermark=0.5,
                    prefill_max_sum_seqlen_k=4096, cp_size=2, lookahead_tokens=1,
                    partial_prompts_first=True, prefill_attempt_interval=7,
                    max_num_batched_tokens=512)
    config = config_from_dict({"mode": "normal", "normal": {"engine": policies}})
    engine = EngineConfig(**config.normal.rank_engine_settings("m"))
    sched = engine.scheduler_config(num_blocks=100, max_model_len=2048, ring_len=8)
    for name, value in policies.items():
        assert getattr(sched, name) == value
    for f in fields(SchedulerPolicy):
        if f.name not in policies:
            assert getattr(sched, f.name) == getattr(EngineConfig(model_dir="m"), f.name)


def test_flags_set_typed_engine_settings_and_are_checked(tiny_model_dir):
    from pdserve.cli import build_parser
    from pdserve.router.serve_command import serve_config

    args = build_parser().parse_args(
        ["serve", "--config", str(EXAMPLE), "--model", str(tiny_model_dir),
         "--max-num-seqs", "0"])
    with pytest.raises(ValueError, match=r"prefill\.engine\.max_num_seqs must be"):
        serve_config(args)


def test_a_pool_on_gpus_runs_its_engines_on_cuda():
    config = config_from_dict({"prefill": {"num_gpus": 1},
                               "decode": {"num_gpus": 1, "engine": {"device": "cpu"}}})
    assert config.prefill.rank_engine_settings("m")["device"] == "cuda"
    assert config.decode.rank_engine_settings("m")["device"] == "cpu"  # told otherwise
    assert config.normal.rank_engine_settings("m")["device"] == "cpu"
