"""Checks declared beside settings fields (scheduler/field_checks.py), and the scheduler's
settings that use them: every field refuses a bad value with a message that starts with
its name, None passes only where it is declared, a bool is not taken for a number."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from pdserve.scheduler.config import SchedulerConfig, SchedulerPolicy
from pdserve.scheduler.field_checks import (
    REQUIRED,
    Bool,
    Integer,
    Number,
    OneOf,
    OrNone,
    check_fields,
    checked,
)


@dataclass(kw_only=True)
class _Base:
    count: int = checked(1, Integer(ge=1))
    note: str = "free"  # no check declared: anything passes


@dataclass(kw_only=True)
class _Settings(_Base):
    size: int = checked(REQUIRED, Integer(ge=2, le=8))
    ratio: float = checked(0.5, Number(gt=0, le=1))
    mode: str = checked("a", OneOf(("a", "b", "c")))
    limit: int | None = checked(None, OrNone(Integer(ge=0)))
    on: bool = checked(True, Bool())


def _message(**kw) -> str:
    with pytest.raises(ValueError) as err:
        check_fields(_Settings(**kw))
    return str(err.value)


def test_good_values_pass_and_required_fields_stay_required():
    check_fields(_Settings(size=2, ratio=1, limit=0, note=None))  # an int is a number
    check_fields(_Settings(size=8, ratio=1e-9, mode="c", limit=None, on=False))
    with pytest.raises(TypeError, match="size"):
        _Settings()  # REQUIRED: no default


@pytest.mark.parametrize("kw, message", [
    ({"size": True}, "size must be an integer, got True"),  # a bool is not 1
    ({"size": 4.0}, "size must be an integer, got 4.0"),
    ({"size": 1}, "size must be >= 2, got 1"),
    ({"size": 9}, "size must be <= 8, got 9"),
    ({"ratio": False}, "ratio must be a number, got False"),
    ({"ratio": 0}, "ratio must be > 0, got 0"),  # open below
    ({"ratio": math.nan}, "ratio must be > 0, got nan"),  # NaN fails every bound
    ({"ratio": "1"}, "ratio must be a number, got '1'"),
    ({"mode": "d"}, "mode must be one of a, b, c, got 'd'"),
    ({"limit": -1}, "limit must be >= 0 or None, got -1"),
    ({"limit": True}, "limit must be an integer or None, got True"),
    ({"on": "no"}, "on must be true or false, got 'no'"),
    ({"on": 0}, "on must be true or false, got 0"),
])
def test_a_refused_value_names_its_field_first(kw, message):
    assert _message(**{"size": 4, **kw}) == message


@pytest.mark.parametrize("name", ["size", "ratio", "mode", "on"])
def test_none_is_refused_where_not_declared(name):
    assert _message(**{"size": 4, name: None}).startswith(f"{name} must be ")


def test_the_first_bad_field_in_declaration_order_is_reported():
    # inherited fields come first, as dataclasses.fields lists them
    assert _message(count=0, size=0, mode="x").startswith("count must be >= 1")
    assert _message(size=0, mode="x").startswith("size must be >= 2")


# (field, a bad value, how the message starts): every SchedulerPolicy field had a rule
# before the checks were declared, and still has one.
POLICY_BAD = [
    ("block_size", 0, "block_size must be >= 1, got 0"),
    ("max_num_seqs", 0, "max_num_seqs must be >= 1, got 0"),
    ("max_num_seqs", True, "max_num_seqs must be an integer, got True"),
    ("max_num_batched_tokens", "512", "max_num_batched_tokens must be an integer or None"),
    ("max_num_batched_tokens", 50, "max_num_batched_tokens (50) must be >= max_num_seqs (64)"),
    ("chunked_prefill", "no", "chunked_prefill must be true or false, got 'no'"),
    ("stop_preempted_request", 1, "stop_preempted_request must be true or false, got 1"),
    ("prefill_attempt_interval", 0, "prefill_attempt_interval must be >= 1, got 0"),
    ("prefill_any_attempt_interval", 0, "prefill_any_attempt_interval must be >= 1"),
    ("prefill_watermark", 1.5, "prefill_watermark must be <= 1, got 1.5"),
    ("prefill_watermark", -0.1, "prefill_watermark must be >= 0, got -0.1"),
    ("prefill_watermark", True, "prefill_watermark must be a number, got True"),
    ("prefill_max_sum_seqlen_k", 1.5, "prefill_max_sum_seqlen_k must be an integer or None"),
    ("cp_size", 0, "cp_size must be >= 1, got 0"),
    ("lookahead_tokens", -1, "lookahead_tokens must be >= 0, got -1"),
    ("continuation_at_back", None, "continuation_at_back must be true or false, got None"),
    ("hol_bypass_limit", -1, "hol_bypass_limit must be >= 0, got -1"),
    ("decode_room_needs_no_block", "yes", "decode_room_needs_no_block must be true or false"),
    ("recompute_structured_output", 0, "recompute_structured_output must be true or false"),
    ("partial_prompts_first", 1, "partial_prompts_first must be true or false, got 1"),
    ("chunk_time_budget_s", 0, "chunk_time_budget_s must be > 0 or None, got 0"),
    ("chunk_time_budget_s", True, "chunk_time_budget_s must be a number or None, got True"),
    ("enable_prefix_caching", "on", "enable_prefix_caching must be true or false, got 'on'"),
]
CONFIG_BAD = [
    ("num_blocks", 1, "num_blocks must be >= 2, got 1"),
    ("num_state_slots", 1.0, "num_state_slots must be an integer, got 1.0"),
    ("max_model_len", 0, "max_model_len must be >= 1, got 0"),
    ("ring_len", False, "ring_len must be an integer, got False"),
]
BASE = dict(num_blocks=100, num_state_slots=10, max_model_len=2048)


def test_every_policy_field_is_covered_below():
    assert {f.name for f in fields(SchedulerPolicy)} == {name for name, _, _ in POLICY_BAD}


@pytest.mark.parametrize("name, value, start", POLICY_BAD)
def test_policy_refuses_a_bad_value_by_field(name, value, start):
    with pytest.raises(ValueError) as err:
        SchedulerPolicy(**{name: value}).check_policy()
    assert str(err.value).startswith(start)
    with pytest.raises(ValueError) as err:
        SchedulerConfig(**BASE, **{name: value})
    assert str(err.value).startswith(start)


@pytest.mark.parametrize("name, value, start", CONFIG_BAD)
def test_config_refuses_a_bad_derived_size_by_field(name, value, start):
    with pytest.raises(ValueError) as err:
        SchedulerConfig(**{**BASE, name: value})
    assert str(err.value).startswith(start)


@pytest.mark.parametrize("name", [f.name for f in fields(SchedulerConfig)])
def test_none_passes_only_where_the_default_is_none(name):
    if SchedulerConfig.__dataclass_fields__[name].default is None:
        SchedulerConfig(**{**BASE, name: None})
    else:
        with pytest.raises(ValueError, match=f"^{name} must be "):
            SchedulerConfig(**{**BASE, name: None})


@pytest.mark.parametrize("kw, start", [
    ({"max_num_seqs": 4, "max_num_batched_tokens": 8},
     "max_num_batched_tokens (8) must be >= block_size (16)"),
    ({"chunk_time_budget_s": 0.1, "chunked_prefill": False},
     "chunk_time_budget_s needs chunked_prefill=True"),
    ({"prefill_max_sum_seqlen_k": 1000}, "prefill_max_sum_seqlen_k (1000) must be >= prompt_limit"),
])
def test_rules_between_fields_run_after_the_declared_checks(kw, start):
    with pytest.raises(ValueError) as err:
        SchedulerConfig(**BASE, **kw)
    assert str(err.value).startswith(start)


def test_the_checks_module_imports_the_standard_library_only():
    """The lowest layer: any settings class may use it (no torch, no other pdserve part)."""
    import ast
    import sys

    import pdserve.scheduler.field_checks as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} <= set(sys.stdlib_module_names)
