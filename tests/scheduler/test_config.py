"""Section 2: configuration defaults and checks."""

from __future__ import annotations

import warnings

import pytest

from pdserve.scheduler import EngineType, Scheduler, SchedulerConfig

BASE = dict(block_size=16, num_blocks=100, num_state_slots=10, max_model_len=2048)


def test_defaults_are_the_engines():
    """One default per setting (scheduler/config.py): the service's and LLM's, not the
    spec's table (256 sequences, no chunked prefill, no prefix caching), which the rule
    tests pass explicitly."""
    c = SchedulerConfig(**BASE)
    assert c.max_num_seqs == 64 and c.enable_prefix_caching
    assert c.max_num_batched_tokens == 4096  # max(max_model_len, 4096, max_num_seqs)
    assert SchedulerConfig(**{**BASE, "max_model_len": 9000}).max_num_batched_tokens == 9000
    assert (c.chunked_prefill, c.stop_preempted_request) == (True, True)
    assert (c.prefill_attempt_interval, c.prefill_any_attempt_interval) == (70, 100)
    assert c.prefill_watermark == 0.9 and c.ring_len == 134 and c.cp_align == 1
    assert SchedulerConfig(**BASE, cp_size=3).cp_align == 6
    assert c.prompt_limit == 2048
    assert not (c.continuation_at_back or c.hol_bypass_limit or c.decode_room_needs_no_block
                or c.recompute_structured_output)


def test_prompt_limit_depends_on_chunking():
    with pytest.warns(UserWarning, match="chunked_prefill"):
        off = SchedulerConfig(**BASE, max_num_batched_tokens=512, chunked_prefill=False)
    assert off.prompt_limit == 512
    assert SchedulerConfig(**BASE, max_num_batched_tokens=512).prompt_limit == 2048


def test_no_warning_when_budget_covers_model_len():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SchedulerConfig(**BASE)


@pytest.mark.parametrize("field,value", [
    ("max_num_batched_tokens", 8),  # < block_size
    ("max_num_batched_tokens", 50),  # < max_num_seqs (64)
    ("prefill_attempt_interval", 0),
    ("prefill_any_attempt_interval", 0),
    ("prefill_max_sum_seqlen_k", 1000),  # < prompt_limit (2048)
    ("block_size", 0),
    ("num_blocks", 1),
    ("max_num_seqs", 0),
    ("cp_size", 0),
    ("prefill_watermark", 1.5),
])
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{**BASE, field: value})


def test_completion_engine_refuses_recompute():
    config = SchedulerConfig(**BASE, stop_preempted_request=False)
    with pytest.raises(ValueError, match="stop_preempted_request.*COMPLETION"):
        Scheduler(config, EngineType.COMPLETION)
    Scheduler(config, EngineType.NORMAL)  # these have a prefill path to recompute on
    Scheduler(config, EngineType.PROMPT)
