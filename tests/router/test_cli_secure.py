"""`pdserve serve` with tokens and TLS, and its clients, as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def _cli(*args, env, timeout=120):
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope="module")
def secure_served(tmp_path_factory, tiny_model_dir, tokens, tls_files, spawn_serve):
    tmp = tmp_path_factory.mktemp("cli_secure")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PDSERVE_CACHE=str(tmp / "cache"),
               PDSERVE_RAY_TMP=f"/tmp/pdsec{os.getpid() % 100000}")
    env.pop("PDSERVE_TOKEN", None)
    tenant_file = tmp / "tokens"
    tenant_file.write_text(open(tokens.tenant_file).read())
    os.chmod(tenant_file, 0o600)
    served = spawn_serve(
        ["--model", tiny_model_dir, "--mode", "normal", "--port", "0", "--num-cpus", "0.25",
         "--auth-token-file", str(tenant_file), "--admin-token-file", tokens.admin_file,
         "--tls-cert-file", tls_files.cert, "--tls-key-file", tls_files.key], env)
    line = served.wait_for("pdserve router listening on ", 180)
    check = served.wait_for("self-check ", 120) if line else None
    assert line and check and "passed" in check, served.log
    served.address = line.split()[-1]
    served.tenant_file = tenant_file
    yield served
    served.stop()


def test_clients_need_a_token_and_the_ca(secure_served, tokens, tls_files, tmp_path):
    addr, env = secure_served.address, secure_served.env
    tls = ["--tls-ca-file", tls_files.ca, "--tls-server-name", "localhost"]
    r = _cli("generate", "--address", addr, *tls, "--max-tokens", "3", "hi", env=env)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr
    r = _cli("generate", "--address", addr, *tls, "--max-tokens", "3", "hi",
             env=dict(env, PDSERVE_TOKEN=tokens.bob))
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    token_file = tmp_path / "alice"
    token_file.write_text(tokens.alice + "\n")
    os.chmod(token_file, 0o600)
    r = _cli("generate", "--address", addr, *tls, "--token-file", str(token_file),
             "--max-tokens", "3", "hi", env=env)
    assert r.returncode == 0, r.stderr
    r = _cli("generate", "--address", addr, "--token-file", str(token_file), "--timeout", "5",
             "--max-tokens", "3", "hi", env=env)  # plaintext to a TLS port
    assert r.returncode == 2 and "cannot reach the router" in r.stderr
    r = _cli("status", "--address", addr, *tls, "--token-file", str(token_file), env=env)
    assert r.returncode == 1 and "PERMISSION_DENIED" in r.stderr
    r = _cli("status", "--address", addr, *tls, "--token-file", tokens.admin_file, env=env)
    assert r.returncode == 0 and "pool normal: 1 ranks" in r.stdout, r.stderr
    os.chmod(token_file, 0o644)
    r = _cli("status", "--address", addr, *tls, "--token-file", str(token_file), env=env)
    assert r.returncode == 2 and "chmod 600" in r.stderr


def test_sighup_reloads_the_token_file(secure_served, tls_files):
    carol = "carol-" + "c" * 30
    old = secure_served.tenant_file.read_text()
    secure_served.tenant_file.write_text(old + f"carol {carol}\n")
    secure_served.proc.send_signal(signal.SIGHUP)
    line = secure_served.wait_for("tokens reloaded", 30)
    assert line and "3 tenants" in line
    r = _cli("generate", "--address", secure_served.address, "--tls-ca-file", tls_files.ca,
             "--tls-server-name", "localhost", "--max-tokens", "2", "hi",
             env=dict(secure_served.env, PDSERVE_TOKEN=carol))
    assert r.returncode == 0, r.stderr
    assert carol not in secure_served.log


def test_the_log_holds_no_token(secure_served, tokens):
    log = secure_served.log
    assert "TLS" in log or "self-check passed" in log
    for secret in (tokens.alice, tokens.bob, tokens.admin):
        assert secret not in log


def test_unsafe_settings_fail_before_ray_starts(tmp_path, tiny_model_dir, tokens):
    env = dict(os.environ, PDSERVE_RAY_TMP=str(tmp_path / "ray"))
    open_file = tmp_path / "tokens"
    open_file.write_text(f"alice {tokens.alice}\n")
    os.chmod(open_file, 0o644)
    r = _cli("serve", "--model", tiny_model_dir, "--auth-token-file", str(open_file), env=env,
             timeout=60)
    assert r.returncode == 2 and "chmod 600" in r.stderr
    r = _cli("serve", "--model", tiny_model_dir, "--host", "0.0.0.0", env=env, timeout=60)
    assert r.returncode == 2 and "--insecure" in r.stderr and "TLS" in r.stderr
    assert not (tmp_path / "ray").exists()  # no Ray was started for either
