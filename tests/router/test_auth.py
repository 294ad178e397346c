"""Router access: tenant tokens, the admin token, per-tenant labels, TLS, the loopback
rule, and token files refused when unsafe. Real routers, real gRPC over TLS."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import grpc
import pytest

from pdserve.router.auth import (
    Authenticator,
    AuthError,
    is_loopback_peer,
    load_tenant_tokens,
    read_client_token,
)
from pdserve.router.client import Client
from pdserve.router.config import RouterConfig

UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def secure_router(make_router, tokens, tls_files):
    router = make_router(mode="normal", normal=1, auth_token_file=tokens.tenant_file,
                         admin_token_file=tokens.admin_file, tls_cert_file=tls_files.cert,
                         tls_key_file=tls_files.key)
    yield router
    router.close()


def client(router, tls_files, token=None, **kwargs) -> Client:
    return Client(router.address, timeout=60, token=token, tls_ca_file=tls_files.ca,
                  tls_server_name="localhost", **kwargs)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_missing_or_wrong_tokens_are_unauthenticated(secure_router, tls_files, tokens):
    # the last character changed (to one it is not: a random token may end in "A")
    changed = tokens.alice[:-1] + ("B" if tokens.alice.endswith("A") else "A")
    for token in (None, "x" * 32, changed, tokens.alice + "x"):
        with client(secure_router, tls_files, token) as c:
            assert code_of(lambda: c.generate("hi", max_tokens=2)) == UNAUTH
            assert code_of(lambda: c.abort("a")) == UNAUTH
            assert code_of(lambda: c.cluster_state()) == UNAUTH
            assert code_of(lambda: c.scale("normal", 1)) == UNAUTH
            assert code_of(lambda: c.timeline()) == UNAUTH
    # A malformed authorization header is refused the same way.
    with grpc.secure_channel(secure_router.address,
                             grpc.ssl_channel_credentials(open(tls_files.ca, "rb").read()),
                             options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        from pdserve.rpc import router_pb2, router_pb2_grpc

        stub = router_pb2_grpc.RouterStub(ch)
        for header in (f"Basic {tokens.alice}", tokens.alice, "Bearer "):
            with pytest.raises(grpc.RpcError) as info:
                stub.Abort(router_pb2.AbortRequest(request_id="a"), timeout=10,
                           metadata=(("authorization", header),))
            assert info.value.code() == UNAUTH


def test_tenants_generate_and_only_the_admin_sees_or_scales(secure_router, tls_files, tokens,
                                                            reference):
    want = reference(["def add(x, y):"], 6)[0]
    for token in (tokens.alice, tokens.bob, tokens.admin):
        with client(secure_router, tls_files, token) as c:
            out = c.generate("def add(x, y):", max_tokens=6, temperature=0)
        assert out.token_ids == want and out.finish_reason == "length"
    # the second token listed for alice (a rotation in progress) is alice too
    old = open(tokens.tenant_file).read().split("alice ")[2].split()[0]
    with client(secure_router, tls_files, old) as c:
        assert c.generate("def add(x, y):", max_tokens=2, temperature=0).finish_reason == "length"
    with client(secure_router, tls_files, tokens.alice) as c:
        assert code_of(lambda: c.scale("normal", 2)) == DENIED
        assert code_of(lambda: c.cluster_state()) == DENIED
        assert code_of(lambda: c.timeline()) == DENIED
    assert len(secure_router.service.pools["normal"].ranks) == 1  # the denied scale did nothing
    with client(secure_router, tls_files, tokens.admin) as c:
        state = c.cluster_state()
        assert state.mode == "normal" and len(state.pools[0].ranks) == 1
        assert c.scale("normal", 1).previous_replicas == 1
        assert isinstance(c.timeline(), list)


def test_health_stays_open_without_a_token(secure_router, tls_files):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = grpc.ssl_channel_credentials(open(tls_files.ca, "rb").read())
    with grpc.secure_channel(secure_router.address, creds,
                             options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="pdserve.rpc.Router"), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_one_tenant_cannot_abort_reuse_or_observe_anothers_requests(secure_router, tls_files,
                                                                    tokens):
    alice = client(secure_router, tls_files, tokens.alice)
    bob = client(secure_router, tls_files, tokens.bob)
    chunks = []
    done = threading.Event()

    def alice_stream():
        try:
            for msg in alice.stream("def add(x, y):", request_id="job-1", max_tokens=400,
                                    ignore_eos=True, temperature=0):
                chunks.append(msg)
        finally:
            done.set()

    t = threading.Thread(target=alice_stream)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not chunks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert chunks, "alice's request never started"
        # the same label is bob's own to use while hers is in flight
        out = bob.generate("hello", request_id="job-1", max_tokens=3, temperature=0)
        assert out.request_id == "job-1" and out.finish_reason == "length"
        # bob names the label: nothing of alice's is found or ended
        assert bob.abort("job-1") is False
        time.sleep(0.3)
        assert not done.is_set() and not any(m.finish_reason for m in chunks)
        # alice's own second "job-1" is a duplicate
        assert code_of(lambda: alice.generate("x", request_id="job-1", max_tokens=2)) == \
            grpc.StatusCode.ALREADY_EXISTS
        assert alice.abort("job-1") is True
        assert done.wait(30)
    finally:
        alice.abort("job-1")
        t.join(30)
    assert chunks[-1].finish_reason == "abort" and chunks[0].request_id == "job-1"
    # An early abort by bob does not reach alice's request of that label.
    assert bob.abort("later") is False
    out = alice.generate("def add(x, y):", request_id="later", max_tokens=3, temperature=0)
    assert out.finish_reason == "length"
    out = bob.generate("def add(x, y):", request_id="later", max_tokens=3, temperature=0)
    assert out.finish_reason == "abort"  # bob's own early abort does
    alice.close()
    bob.close()
    secure_router.assert_nothing_left()


def test_tls_needs_the_ca_that_signed_the_certificate(secure_router, tls_files, tokens):
    with Client(secure_router.address, timeout=5, token=tokens.alice) as plain:
        assert code_of(lambda: plain.generate("hi", max_tokens=2)) == grpc.StatusCode.UNAVAILABLE
    with Client(secure_router.address, timeout=5, token=tokens.alice,
                tls_ca_file=tls_files.other_ca, tls_server_name="localhost") as wrong_ca:
        assert code_of(lambda: wrong_ca.generate("hi", max_tokens=2)) == \
            grpc.StatusCode.UNAVAILABLE
    with Client(secure_router.address, timeout=30, token=tokens.alice,
                tls_ca_file=tls_files.ca) as good:  # 127.0.0.1 is in the certificate too
        assert good.generate("hi", max_tokens=2, temperature=0).finish_reason == "length"


def test_tokens_never_reach_logs_or_reprs(secure_router, tls_files, tokens, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "w" * 40
    for token in (tokens.alice, wrong):
        with client(secure_router, tls_files, token) as c:
            try:
                c.generate("hi", max_tokens=2)
            except grpc.RpcError as exc:
                assert token not in (exc.details() or "")
            assert token not in repr(c)
    text = caplog.text + repr(secure_router.server.auth)
    for secret in (tokens.alice, tokens.bob, tokens.admin, wrong):
        assert secret not in text


def test_without_an_admin_token_internals_are_for_loopback_peers_only(make_router):
    """A router on every interface (plaintext, --insecure): a caller on the machine's
    network address may generate but not scale or read the cluster state."""
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    router = make_router(mode="normal", normal=1, host="0.0.0.0", insecure=True)
    try:
        port = router.server.port
        with Client(f"{ip}:{port}", timeout=30) as remote:
            assert remote.generate("hi", max_tokens=2, temperature=0).finish_reason == "length"
            assert code_of(lambda: remote.scale("normal", 2)) == DENIED
            assert code_of(lambda: remote.cluster_state()) == DENIED
        with Client(f"127.0.0.1:{port}", timeout=30) as local:
            assert local.cluster_state().mode == "normal"
    finally:
        router.close()


def _non_loopback_ip() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing interface
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


# -- the rules on their own ----------------------------------------------------------

def test_a_non_loopback_host_needs_tls_or_insecure(tls_files):
    with pytest.raises(ValueError, match="--insecure"):
        RouterConfig(model_dir="m", host="0.0.0.0").validate()
    RouterConfig(model_dir="m", host="0.0.0.0", insecure=True).validate()
    RouterConfig(model_dir="m", host="0.0.0.0", tls_cert_file=tls_files.cert,
                 tls_key_file=tls_files.key).validate()
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        RouterConfig(model_dir="m", host=host).validate()
    with pytest.raises(ValueError, match="go together"):
        RouterConfig(model_dir="m", tls_cert_file=tls_files.cert).validate()


def test_token_files_are_checked(tmp_path):
    def write(name, text, mode=0o600):
        p = tmp_path / name
        p.write_text(text)
        os.chmod(p, mode)
        return str(p)

    good = "t" * 20
    with pytest.raises(ValueError, match="chmod 600"):
        load_tenant_tokens(write("open", f"a {good}\n", 0o644))
    with pytest.raises(ValueError, match="at least|printable"):
        load_tenant_tokens(write("short", "a short\n"))
    with pytest.raises(ValueError, match="<tenant> <token>"):
        load_tenant_tokens(write("bare", f"{good}\n"))
    with pytest.raises(ValueError, match="tenants 'a' and 'b'"):
        load_tenant_tokens(write("dup", f"a {good}\nb {good}\n"))
    with pytest.raises(ValueError, match="tenant name"):
        load_tenant_tokens(write("name", f"a/b {good}\n"))
    with pytest.raises(ValueError, match="no token"):
        load_tenant_tokens(write("empty", "# nothing\n"))
    with pytest.raises(ValueError, match="differ"):
        Authenticator(write("t", f"a {good}\n"), write("adm", f"{good}\n"))
    assert read_client_token(write("c", f"a {good}\n")) == good
    assert read_client_token(None, {"PDSERVE_TOKEN": good}) == good
    assert read_client_token(None, {}) is None


def test_reload_swaps_tokens_and_keeps_the_old_ones_on_a_bad_file(tmp_path):
    path = tmp_path / "tokens"
    first, second = "1" * 20, "2" * 20
    path.write_text(f"a {first}\n")
    os.chmod(path, 0o600)
    auth = Authenticator(str(path))
    meta = lambda t: (("authorization", f"Bearer {t}"),)  # noqa: E731
    assert auth.authenticate(meta(first)).tenant == "a"
    path.write_text(f"b {second}\n")
    auth.reload()
    assert auth.authenticate(meta(second)).tenant == "b"
    with pytest.raises(AuthError):
        auth.authenticate(meta(first))
    path.write_text("broken line\n")
    with pytest.raises(ValueError):
        auth.reload()
    assert auth.authenticate(meta(second)).tenant == "b"


def test_loopback_peers():
    for peer in ("ipv4:127.0.0.1:5000", "ipv4:127.3.2.1:1", "ipv6:[::1]:5000",
                 "ipv6:[::ffff:127.0.0.1]:5000", "unix:/tmp/sock"):
        assert is_loopback_peer(peer), peer
    for peer in ("ipv4:10.0.0.1:5000", "ipv6:[2001:db8::1]:5000", "ipv6:[::ffff:10.0.0.1]:1",
                 "", "garbage"):
        assert not is_loopback_peer(peer), peer
    auth = Authenticator()
    assert auth.authorize_admin((), "ipv4:127.0.0.1:1").tenant == ""
    with pytest.raises(AuthError) as info:
        auth.authorize_admin((), "ipv4:10.0.0.1:1")
    assert info.value.code == DENIED


def test_make_tokens_writes_private_files_that_serve_accepts(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "secrets"
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "make-tokens", str(folder),
                        "--tenants", "alice,bob"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    tenant_file, admin_file = folder / "tokens", folder / "admin_token"
    for path in (tenant_file, admin_file):
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert path.read_text().split()[-1] not in r.stdout  # tokens only in the files
    auth = Authenticator(str(tenant_file), str(admin_file))
    assert auth.tenants == ["alice", "bob"]
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "make-tokens", str(folder)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not overwriting" in r.stderr


def test_bench_serve_runs_against_a_secured_router(secure_router, tls_files, tokens,
                                                   tiny_model_dir, tmp_path):
    import json

    from pdserve.bench.serve import main as serve_main

    token_file = tmp_path / "token"
    token_file.write_text(tokens.bob + "\n")
    os.chmod(token_file, 0o600)
    out = tmp_path / "serve.json"
    common = ["--address", secure_router.address, "--model", tiny_model_dir,
              "--num-prompts", "2", "--random-input-len", "12", "--random-output-len", "3",
              "--disable-tqdm", "--no-plot", "--result-file", str(out)]
    assert serve_main([*common, "--token-file", str(token_file), "--tls-ca-file", tls_files.ca,
                       "--tls-server-name", "localhost"]) == 0
    assert json.loads(out.read_text())["completed"] == 2
    assert serve_main(common) == 2  # no token, no CA: a clear error, no result
