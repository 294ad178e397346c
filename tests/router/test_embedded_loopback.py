"""`pdserve serve` with its embedded Ray listens on loopback only: the router, its metrics,
gcs, raylet, the agents and every rank (a real process tree, read from /proc)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
# /proc/net/* state of a listening TCP socket, and of a bound, unconnected UDP one
STATES = {"tcp": "0A", "tcp6": "0A", "udp": "07", "udp6": "07"}


def _ppids() -> dict[int, int]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        out[int(stat.parent.name)] = int(text[text.rindex(")") + 2:].split()[1])
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


def _service_pids(root: int | None, marker: str) -> set[int]:
    """``root`` and its descendants, and any process whose environment carries our
    PDSERVE_RAY_TMP (a Ray process reparented away from the tree would still have it)."""
    ppids = _ppids()
    pids = {p for p in ppids if _environ(p).get("PDSERVE_RAY_TMP") == marker}
    if root is not None and root in ppids:
        pids.add(root)
        grew = True
        while grew:
            new = {p for p, pp in ppids.items() if pp in pids} - pids
            pids |= new
            grew = bool(new)
    return pids


def _decode(hexaddr: str) -> tuple[ipaddress._BaseAddress, int]:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)  # 32-bit words in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw), int(port, 16)


def _listening_sockets(pids: set[int]) -> list[tuple[str, str, int, int, str]]:
    """(proto, address, port, pid, comm) of every listening TCP / bound UDP socket the
    processes hold."""
    owner = _socket_owners(pids)
    out = []
    for proto, state in STATES.items():
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, st, inode = fields[1], fields[3], fields[9]
            if st != state or inode not in owner:
                continue
            ip, port = _decode(local)
            if port == 0:
                continue
            pid = owner[inode]
            mapped = getattr(ip, "ipv4_mapped", None)
            out.append((proto, f"::ffff:{mapped}" if mapped else str(ip), port, pid, _comm(pid)))
    return out


def _socket_owners(pids: set[int]) -> dict[str, int]:
    """The socket inodes the processes hold open, each with its process."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    return owner


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback  # 127.0.0.0/8, ::1


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _need_compiler():
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: serve cannot build its loopback-bind shim")


SHIM_PROBE = """
import ctypes, socket
def bound(family, host, v6only=None):
    s = socket.socket(family)
    if v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    s.bind((host, 0))
    return s.getsockname()[0]
print(bound(socket.AF_INET, "0.0.0.0"), bound(socket.AF_INET, "127.0.0.2"),
      bound(socket.AF_INET6, "::", 0), bound(socket.AF_INET6, "::", 1))
u = socket.socket(socket.AF_UNIX); u.bind("\\0pdserve-probe"); print(u.getsockname())
from pdserve.router.embedded_ray import public_binds
with public_binds("0.0.0.0"):
    print(bound(socket.AF_INET, "0.0.0.0"))
with public_binds("127.0.0.1"):
    print(bound(socket.AF_INET, "0.0.0.0"))
"""


def test_shim_rewrites_binds_to_loopback_and_public_binds_lets_them_through():
    from pdserve.router.embedded_ray import build_shim, is_loopback, public_binds, shim_loaded

    _need_compiler()
    path, why = build_shim()
    assert path is not None, why
    r = subprocess.run([sys.executable, "-c", SHIM_PROBE], capture_output=True, text=True,
                       env=dict(os.environ, LD_PRELOAD=str(path)), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "127.0.0.1 127.0.0.2 ::ffff:127.0.0.1 ::1",  # IPv4 clients reach a dual-stack one
        "b'\\x00pdserve-probe'",  # not IP: untouched
        "0.0.0.0",  # the router's own public port, asked for
        "127.0.0.1",  # a loopback host allows nothing
    ], r.stdout
    assert not shim_loaded()  # not in pytest: public_binds is a no-op here
    with public_binds("0.0.0.0"):
        pass
    assert [is_loopback(h) for h in ("localhost", "127.0.0.5", "[::1]", "::ffff:127.0.0.1",
                                     "0.0.0.0", "::", "", "192.0.2.2", "example.org")] == \
        [True] * 4 + [False] * 5


def _scan(root: int, marker: str, seen: set[int], sockets: set[tuple], rounds: int = 3) -> str:
    """Add the service's listening sockets to ``sockets`` (its processes to ``seen``) and
    check that none listens beyond loopback; returns the listing."""
    for _ in range(rounds):  # a late binder (an agent, a rank's server) is seen
        seen.update(_service_pids(root, marker))
        sockets |= set(_listening_sockets(seen))
        time.sleep(1)
    listing = "\n".join(f"{p} {a}:{n} {c}[{pid}]" for p, a, n, pid, c in sorted(sockets))
    public = [s for s in sockets if not _loopback(s[1])]
    assert not public, f"listening beyond loopback:\n{listing}"
    return listing


def _check_ray_environment(driver_pid: int, pids: set[int]) -> None:
    """The shim is preloaded into serve, and Ray's token authentication stays on."""
    driver = _environ(driver_pid)
    assert "loopback_bind" in driver.get("LD_PRELOAD", ""), driver.get("LD_PRELOAD")
    assert driver.get("RAY_AUTH_MODE") != "disabled"
    for pid in pids:
        assert _environ(pid).get("RAY_AUTH_MODE") != "disabled", pid


def _stop_and_check_nothing_outlives(proc: subprocess.Popen, marker: str) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 30  # ray.shutdown ends the processes it started
    while time.monotonic() < deadline and _service_pids(None, marker):
        time.sleep(0.5)
    assert not _service_pids(None, marker), "Ray processes outlived serve"


@pytest.mark.slow
def test_embedded_serve_binds_every_socket_to_loopback(tmp_path, tiny_model_dir, spawn_serve):
    _need_compiler()
    marker = f"/tmp/pdlb{os.getpid() % 100000}"  # short: Ray's socket paths live in it
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PDSERVE_CACHE=str(tmp_path / "cache"),
               PDSERVE_RAY_TMP=marker)
    # serve's default model is generated into the cache on first use: share the session's
    os.makedirs(tmp_path / "cache")
    os.symlink(tiny_model_dir, tmp_path / "cache" / "tiny-llama")
    assert not _service_pids(None, marker), "a Ray from an earlier run is still there"

    serve = spawn_serve(["--model", "tiny", "--port", "0", "--no-self-check", "--num-cpus",
                         "0.25"], env)
    proc = serve.proc
    seen: set[int] = set()
    try:
        # before Ray starts: nothing listens (the scan sees only the service's sockets)
        assert _listening_sockets(_service_pids(proc.pid, marker)) == []
        line = serve.wait_for("pdserve router listening on ", 150)
        port = int(line.rsplit(":", 1)[1]) if line else None
        line = serve.wait_for("metrics on http://", 30) if line else None
        metrics = int(line.rsplit(":", 1)[1].split("/")[0]) if line else None
        log = serve.log
        assert port and metrics, log
        assert "loopback-bind shim" not in log, log  # built and loaded, no warning

        sockets: set[tuple] = set()
        listing = _scan(proc.pid, marker, seen, sockets)
        # the check can fail only if it sees the service's sockets: all of them are here
        comms = {s[4] for s in sockets}
        ports = {s[2] for s in sockets}
        assert len(sockets) >= 6, listing
        assert {"gcs_server", "raylet"} <= comms, listing
        assert any(c.startswith("ray::Prefill") for c in comms), listing
        assert any(c.startswith("ray::Decode") for c in comms), listing
        assert {port, metrics} <= ports, listing

        # Two prefill ranks form a data-parallel group: a TCPStore while it forms, then
        # gloo's listeners in both ranks, and the new rank's own core-worker server.
        r = subprocess.run([*PDSERVE, "scale", "--address", f"127.0.0.1:{port}", "prefill",
                            "2"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        before_scale = len(sockets)
        listing = _scan(proc.pid, marker, seen, sockets, rounds=2)
        assert len(sockets) >= before_scale + 3, listing

        _check_ray_environment(proc.pid, seen)
        _stop_and_check_nothing_outlives(proc, marker)
    finally:  # on a failure too: no Ray process may outlive the test (pids taken now,
        # not earlier ones that may have been reused since)
        _kill(_service_pids(proc.pid if proc.poll() is None else None, marker))
        proc.wait(30)
        shutil.rmtree(marker, ignore_errors=True)
