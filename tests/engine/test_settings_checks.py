"""EngineSettings' checks (engine/config.py; declared beside each field through
scheduler/field_checks.py, the rules between fields explicit): every field that has a
rule refuses a bad value with a message that starts with its name, which a serve
config's path prefixes; None passes only where it is declared."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pdserve.engine.config import EngineConfig, EngineSettings
from pdserve.scheduler.config import SchedulerPolicy

# The engine's own fields that take anything (passed on as they are).
UNCHECKED = {"num_threads", "compile", "decode_kernel"}

# (field, a bad value, how the message starts); the policy's fields are covered by
# tests/scheduler/test_field_checks.py, one of them here to see it checked through
# EngineSettings.
BAD = [
    ("max_num_seqs", False, "max_num_seqs must be an integer, got False"),
    ("num_kv_blocks", 1, "num_kv_blocks must be >= 2 or None, got 1"),
    ("num_kv_blocks", True, "num_kv_blocks must be an integer or None, got True"),
    ("kv_cache_memory_mb", 0, "kv_cache_memory_mb must be >= 1, got 0"),
    ("kv_cache_memory_mb", 512.0, "kv_cache_memory_mb must be an integer, got 512.0"),
    ("max_model_len", 0, "max_model_len must be >= 1 or None, got 0"),
    ("dtype", "float8", "dtype must be one of auto, float32, bfloat16, float16, got 'float8'"),
    ("device", "gpu", "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("kernel_isa", "sse9", "kernel_isa must be one of auto, avx512, avx2, generic, got 'sse9'"),
    ("quantization", "int4", "quantization must be one of auto, int8, bf16, none, got 'int4'"),
    ("activation_precision", "int4",
     "activation_precision must be one of auto, fp32, int8, got 'int4'"),
    ("kv_precision", "fp8", "kv_precision must be one of auto, fp32, fp16, got 'fp8'"),
    ("kv_copy_threads", 0, "kv_copy_threads must be >= 1, got 0"),
    ("kv_copy_threads", 65, "kv_copy_threads must be <= 64, got 65"),
    ("speculative", "eagle", "speculative must be one of off, ngram, draft, got 'eagle'"),
    ("num_speculative_tokens", 0, "num_speculative_tokens must be >= 1, got 0"),
    ("num_speculative_tokens", 17, "num_speculative_tokens must be <= 16, got 17"),
    ("ngram_min", 0, "ngram_min must be >= 1, got 0"),
    ("ngram_min", 5, "ngram_min must be <= ngram_max, got 5, 4"),  # between fields
    ("ngram_max", 17, "ngram_max must be <= 16, got 17"),
    ("speculative_adaptive", "yes", "speculative_adaptive must be true or false, got 'yes'"),
    ("draft_model", "tiny", "draft_model must be set exactly when speculative is draft"),
]


def test_every_engine_field_with_a_rule_is_covered_above():
    own = {f.name for f in fields(EngineSettings)} - {f.name for f in fields(SchedulerPolicy)}
    assert own - UNCHECKED == {name for name, _, _ in BAD} - {"max_num_seqs"}


@pytest.mark.parametrize("name, value, start", BAD)
def test_a_bad_setting_is_refused_by_field(name, value, start):
    with pytest.raises(ValueError) as err:
        EngineSettings(**{name: value})
    assert str(err.value).startswith(start)
    with pytest.raises(ValueError) as err:
        EngineSettings.from_mapping({name: value}, "prefill.engine")
    assert str(err.value).startswith(f"prefill.engine.{start}")
    settings = EngineSettings()
    setattr(settings, name, value)  # a flag changed it after construction
    with pytest.raises(ValueError, match=f"^{name} "):
        settings.check()


@pytest.mark.parametrize("name", sorted({f.name for f in fields(EngineSettings)} - UNCHECKED))
def test_none_passes_only_where_the_default_is_none(name):
    if EngineSettings.__dataclass_fields__[name].default is None:
        EngineSettings(**{name: None})
    else:
        with pytest.raises(ValueError, match=f"^{name} must be "):
            EngineSettings(**{name: None})


def test_the_speculative_rules_between_fields():
    EngineSettings(speculative="draft", draft_model="tiny")
    with pytest.raises(ValueError, match="^draft_model must be set exactly"):
        EngineSettings(speculative="draft")
    EngineSettings(ngram_min=3, ngram_max=3)


def test_engine_type_is_one_of_three():
    assert EngineConfig(model_dir="m", engine_type="completion").engine_type == "completion"
    with pytest.raises(ValueError, match="^engine_type must be one of normal, prompt, completion"):
        EngineConfig(model_dir="m", engine_type="decode")
