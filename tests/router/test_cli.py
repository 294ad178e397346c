"""`pdserve serve | generate | status | scale` as a user runs them: real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def _env(tmp):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE",
               PDSERVE_CACHE=str(tmp / "cache"), PDSERVE_RAY_TMP=f"/tmp/pdcli{os.getpid() % 100000}")
    return env


def _cli(*args, env=None, timeout=120):
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir, spawn_serve):
    tmp = tmp_path_factory.mktemp("cli")
    env = _env(tmp)
    # The tiny model is generated on first use into the cache; share the session's copy
    # to save time (generation itself is covered by the make-tiny-model tests).
    os.makedirs(tmp / "cache", exist_ok=True)
    os.symlink(tiny_model_dir, tmp / "cache" / "tiny-llama")
    serve = spawn_serve(["--model", "tiny", "--port", "0", "--num-cpus", "0.25"], env)
    line = serve.wait_for("pdserve router listening on ", 180)
    check = serve.wait_for("self-check ", 120) if line else None
    assert line and check and "passed" in check, serve.log
    yield {"address": line.split()[-1], "env": env, "proc": serve.proc, "log": serve.log}
    serve.stop()


def test_serve_prints_address_client_command_and_self_check(served):
    log = served["log"]
    assert f"--address {served['address']}" in log  # a client command to copy
    assert "(model 'tiny-llama')" in log  # its id in the HTTP API
    # the tiny model has a chat template: the self-check asks a chat question
    assert "self-check: 'What is the capital of France?' -> " in log


def test_generate_json_equals_offline_llm_then_status_and_scale(served, reference):
    addr, env = served["address"], served["env"]
    prompts = ["def add(x, y):", "the quick brown fox"]

    def generate_all():
        outs = []
        for p in prompts:
            r = _cli("generate", "--address", addr, "--max-tokens", "12", "--temperature", "0",
                     "--json", p, env=env)
            assert r.returncode == 0, r.stderr
            outs.append(json.loads(r.stdout))
        return outs

    want = reference(prompts, 12)
    for out, ref in zip(generate_all(), want, strict=True):
        assert out["token_ids"] == ref and out["finish_reason"] == "length" and out["text"]

    r = _cli("status", "--address", addr, env=env)
    assert r.returncode == 0, r.stderr
    assert "pool prefill: 1 ranks" in r.stdout and "pool decode: 1 ranks" in r.stdout

    for pool in ("prefill", "decode"):
        r = _cli("scale", "--address", addr, pool, "2", env=env, timeout=240)
        assert r.returncode == 0, r.stderr
        assert f"pool {pool}: 1 -> 2 ranks" in r.stdout
    r = _cli("status", "--address", addr, "--json", env=env)
    state = json.loads(r.stdout)
    assert [len(p["ranks"]) for p in state["pools"]] == [2, 2]
    for out, ref in zip(generate_all(), want, strict=True):  # 2 ranks per pool
        assert out["token_ids"] == ref

    # plain streaming text, and an error that names its field
    r = _cli("generate", "--address", addr, "--max-tokens", "4", "one", env=env)
    assert r.returncode == 0 and r.stdout.strip()
    r = _cli("generate", "--address", addr, "--max-tokens", "0", "one", env=env)
    assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "max_tokens" in r.stderr


def test_status_of_an_unreachable_router_exits_non_zero(tmp_path):
    r = _cli("status", "--address", "127.0.0.1:1", "--timeout", "2", env=_env(tmp_path))
    assert r.returncode != 0
    assert "cannot reach the router" in r.stderr
