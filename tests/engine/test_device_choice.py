"""Which device and dtype an engine runs on (engine/config.py: engine_device,
engine_dtype): "auto" is the GPU where torch sees one, bf16 there, else the CPU in fp32;
a GPU asked for where there is none, or a device torch cannot name, is refused with a
message naming it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig, EngineSettings, engine_device, engine_dtype


def test_auto_takes_the_gpu_where_there_is_one_and_bf16_there():
    assert engine_device("auto", cuda_available=True) == "cuda"
    assert engine_device("auto", cuda_available=False) == "cpu"
    assert engine_dtype("auto", "cuda") == "bfloat16"
    assert engine_dtype("auto", "cuda:1") == "bfloat16"
    assert engine_dtype("auto", "cpu") == "float32"
    assert engine_dtype("float16", "cuda") == "float16"  # told otherwise
    assert engine_device("cuda:1", cuda_available=True) == "cuda:1"


def test_a_gpu_asked_for_where_there_is_none_is_refused():
    with pytest.raises(ValueError, match=r"device cuda: torch sees no GPU"):
        engine_device("cuda", cuda_available=False)


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "", "CPU"])
def test_a_device_torch_cannot_name_is_refused_by_field(bad):
    with pytest.raises(ValueError, match=r"^device must be auto, cpu, cuda or cuda:N"):
        EngineSettings(device=bad)
    with pytest.raises(ValueError, match=r"^dtype must be one of auto"):
        EngineSettings(dtype="float8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's default")
def test_the_defaults_run_on_this_cpu_in_fp32(tiny_model_dir):
    from pdserve.engine.model_runner import ModelRunner

    config = EngineConfig(model_dir=tiny_model_dir)
    assert (config.device, config.dtype) == ("auto", "auto")
    runner = ModelRunner.from_engine_config(config)
    assert (runner.device.type, runner.dtype) == ("cpu", torch.float32)
    with pytest.raises(ValueError, match="torch sees no GPU"):
        ModelRunner(tiny_model_dir, device="cuda")
