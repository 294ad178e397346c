"""The planner's settings: YAML fields and `pdserve serve` flags of the same names,
validated at start with errors that name the field (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.router.config import config_from_dict, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "router" / "serve.example.yaml"


def test_the_example_file_carries_every_planner_setting_at_its_default():
    from pdserve.router.config import RouterConfig

    config, default = load_config(EXAMPLE), RouterConfig(model_dir="")
    names = [n for n in vars(default) if n.startswith(("planner_", "slo_", "min_", "max_"))
             or n == "autoscale"]
    text = EXAMPLE.read_text()
    for name in names:
        if name.startswith("max_") and name not in ("max_prefill", "max_decode"):
            continue
        assert f"\n{name}:" in text, name
        assert getattr(config, name) == getattr(default, name), name
    assert config.autoscale is False


@pytest.mark.parametrize("data, needle", [
    ({"min_prefill": 3, "max_prefill": 2}, "min_prefill must be >= 1 and <= max_prefill"),
    ({"min_decode": 0}, "min_decode must be >= 1"),
    ({"max_decode": 17}, r"max_decode \(17\) must be <= max_replicas \(16\)"),
    ({"max_prefill": 5, "max_replicas": 4}, r"max_prefill \(5\) must be <= max_replicas"),
    ({"slo_ttft_ms": 0}, "slo_ttft_ms must be a positive number"),
    ({"slo_itl_ms": -5}, "slo_itl_ms must be a positive number"),
    ({"slo_percentile": 0}, "slo_percentile"),
    ({"slo_percentile": 101}, "slo_percentile"),
    ({"planner_interval_s": 0}, "planner_interval_s"),
    ({"planner_cooldown_s": float("inf")}, "planner_cooldown_s"),
    ({"planner_warmup_s": -1}, "planner_warmup_s"),
    ({"planner_min_samples": 0}, "planner_min_samples"),
    ({"autoscale": "yes"}, "autoscale must be true or false"),
    ({"planner_bogus": 1}, "planner_bogus"),
])
def test_a_bad_planner_setting_names_the_field(data, needle):
    with pytest.raises(ValueError, match=needle):
        config_from_dict(data)


def test_autoscale_in_normal_mode_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="autoscale sizes the prefill and decode pools") as err:
        config_from_dict({"mode": "normal", "autoscale": True})
    assert "pdserve scale normal N" in str(err.value)
    assert not config_from_dict({"mode": "normal"}).autoscale  # off: normal mode is fine


def _serve_config(model, *flags):
    from pdserve.cli import build_parser
    from pdserve.router.serve_command import serve_config

    return serve_config(build_parser().parse_args(["serve", "--model", str(model), *flags]))


def test_serve_flags_set_the_fields_of_the_same_names(tiny_model_dir):
    config = _serve_config(tiny_model_dir, "--autoscale", "--slo-ttft-ms", "250", "--slo-itl-ms",
                           "40", "--min-prefill", "2", "--max-prefill", "6", "--min-decode",
                           "1", "--max-decode", "3")
    assert config.autoscale is True
    assert (config.slo_ttft_ms, config.slo_itl_ms) == (250.0, 40.0)
    assert (config.min_prefill, config.max_prefill) == (2, 6)
    assert (config.min_decode, config.max_decode) == (1, 3)
    assert not _serve_config(tiny_model_dir).autoscale  # off unless asked for


def test_flags_override_the_file_and_are_validated(tmp_path, tiny_model_dir):
    path = tmp_path / "serve.yaml"
    path.write_text("autoscale: true\nslo_ttft_ms: 500\nmax_prefill: 3\n")
    config = _serve_config(tiny_model_dir, "--config", str(path), "--max-prefill", "2")
    assert config.autoscale and config.slo_ttft_ms == 500.0 and config.max_prefill == 2
    with pytest.raises(ValueError, match="min_prefill must be >= 1 and <= max_prefill"):
        _serve_config(tiny_model_dir, "--config", str(path), "--min-prefill", "4")
