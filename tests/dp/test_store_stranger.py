"""A stranger on a data-parallel group's store cannot disturb the group.

Rank 0 hosts the group's ``TCPStore`` the way ``EngineRank.open_group_store`` does
(``dp_comm.listen_store``: listening on one address only) and every rank joins through
a client of it, with a nonce in the key prefix (``EngineRank.join_group``). While the
group forms and votes, the test process plays a stranger who reaches the port: raw
garbage, an idle half-open connection, and a real ``TCPStore`` client that sets, gets,
deletes, adds and waits on guessed keys (the old predictable prefix
``pdserve/{pool}/g{generation}``). The votes must stay right and within their timeout;
once rank 0 closed the store (``EngineRank.group_formed``), nobody can connect at all
and the votes go on.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from pdserve.engine.dp_comm import CollectiveError, TorchDistCommunicator, listen_store

WORLD = 3
TIMEOUT_S = 5.0
OLD_PREFIX = "pdserve/decode/g1"  # what the keys were before the nonce: guessable


def value(step: int, rank: int) -> int:
    return (step * 7919 + rank * 104729) % 23 - 5


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout:g}s")
        time.sleep(0.01)


def _publish(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def _group_under_attack(ctx, tmp: str, nonce: str, open_s: float, closed_s: float) -> dict:
    """Rank 0 hosts the store; after the stranger's first round ('go'), every rank joins
    through a client of it and votes, each vote checked and timed. Rank 0 closes the
    store ``open_s`` seconds after the group formed; they vote ``closed_s`` more."""
    tmpdir = Path(tmp)
    rank = ctx.rank
    server = None
    if rank == 0:
        server = listen_store("127.0.0.1", 0, timeout=TIMEOUT_S)
        _publish(tmpdir / "port", str(server.port))
    _wait_for(tmpdir / "go", 60)
    port = int((tmpdir / "port").read_text())
    client = dist.TCPStore("127.0.0.1", port, None, False,
                           timeout=datetime.timedelta(seconds=TIMEOUT_S))
    comm = TorchDistCommunicator(rank, WORLD, client, timeout=TIMEOUT_S,
                                 prefix=f"{OLD_PREFIX}/{nonce}", name=OLD_PREFIX)
    out = {"wrong": [], "worst_s": 0.0, "votes": 0, "error": None, "name": repr(comm)}
    formed = time.monotonic()
    step = 0
    try:
        while True:
            now = time.monotonic()
            if server is not None and now - formed > open_s:
                server = None  # what group_formed does: the last reference goes
                _publish(tmpdir / "closed", "1")
            # stop together: once every rank is past the end
            done = comm.all_reduce_min(int(now - formed > open_s + closed_s))
            t = time.perf_counter()
            got = comm.all_reduce_min(value(step, rank))
            out["worst_s"] = max(out["worst_s"], time.perf_counter() - t)
            want = min(value(step, r) for r in range(WORLD))
            if got != want:
                out["wrong"].append((step, got, want))
            out["votes"] += 1
            step += 1
            if done:
                break
            time.sleep(0.005)
    except CollectiveError as exc:
        out["error"] = str(exc)
    finally:
        comm.close()
    return out


def _listening_on(port: int) -> list[str]:
    ss = subprocess.run(["ss", "-ltn"], capture_output=True, text=True, timeout=10).stdout
    return [cols[3] for cols in (line.split() for line in ss.splitlines())
            if len(cols) > 3 and cols[3].endswith(f":{port}")]


class Stranger:
    """Everything a stranger who reaches the port may do, short of listing the keys."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.held: list[socket.socket] = []
        self.log: list[str] = []
        self.client: dist.TCPStore | None = None

    def hold_half_open(self) -> None:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        self.held.append(s)  # never sends a byte

    def garbage(self) -> None:
        for blob in (os.urandom(4096), b"\xff" * 64, b"GET / HTTP/1.1\r\n\r\n", b"\x00" * 3):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            try:
                s.sendall(blob)
            except OSError:
                pass
            self.held.append(s)  # left open, mid-message

    def guessed_keys(self) -> None:
        if self.client is None:
            self.client = dist.TCPStore("127.0.0.1", self.port, None, False,
                                        timeout=datetime.timedelta(seconds=2))
        c = self.client
        guess = f"{OLD_PREFIX}/{secrets.token_hex(16)}"  # a nonce guessed at random
        for prefix in (OLD_PREFIX, guess):
            for r in range(WORLD):
                c.set(f"{prefix}//0/{r}", os.urandom(32))  # gloo's address keys
            c.get(f"{prefix}//0/0")
            c.add(f"{prefix}/counter", 7)
            c.delete_key(f"{prefix}//0/1")
            c.set(f"{prefix}//0/1", b"127.0.0.1:1")
        c.compare_set(f"{OLD_PREFIX}/cas", "", "x")

    def wait_on_guesses(self) -> threading.Thread:
        def wait():
            c = dist.TCPStore("127.0.0.1", self.port, None, False,
                              timeout=datetime.timedelta(seconds=3))
            try:
                c.wait([f"{OLD_PREFIX}//0/99"], datetime.timedelta(seconds=3))
            except Exception as exc:  # it times out: nobody sets that key
                self.log.append(f"wait: {type(exc).__name__}")

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        for s in self.held:
            s.close()


def test_a_stranger_on_the_store_cannot_disturb_the_group(rank_pool, tmp_path):
    nonce = secrets.token_hex(16)
    result: dict = {}

    def run():
        try:
            result["out"] = rank_pool.run(_group_under_attack, str(tmp_path), nonce, 2.5, 1.5,
                                          ranks=list(range(WORLD)), timeout=90)
        except BaseException as exc:  # reported below
            result["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    _wait_for(tmp_path / "port", 60)
    port = int((tmp_path / "port").read_text())
    stranger = Stranger(port)
    try:
        # the store listens on the address it was given only, not on every interface
        assert _listening_on(port) == [f"127.0.0.1:{port}"]
        # before the group forms: pre-seeded keys, idle and garbage connections, a waiter
        stranger.hold_half_open()
        stranger.garbage()
        stranger.guessed_keys()
        waiter = stranger.wait_on_guesses()
        _publish(tmp_path / "go", "1")
        # while it votes, until rank 0 closes the store
        rounds = 0
        while not (tmp_path / "closed").exists() and runner.is_alive():
            try:
                stranger.hold_half_open()
                stranger.garbage()
                stranger.guessed_keys()
            except Exception:  # the store closed under us (refused, or reset mid-connect)
                break
            rounds += 1
            time.sleep(0.05)
        assert rounds >= 3, "the stranger never got a word in while the store was open"
        _wait_for(tmp_path / "closed", 30)
        time.sleep(0.2)
        # closed: nobody can connect any more (the group goes on without it)
        assert _listening_on(port) == []
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with pytest.raises(Exception):  # noqa: B017 - torch raises DistNetworkError here
            dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=1))
        runner.join(90)
        waiter.join(10)
    finally:
        stranger.close()
    assert not runner.is_alive()
    assert "error" not in result, result.get("error")
    for r, out in enumerate(result["out"]):
        assert out["error"] is None, (r, out["error"])
        assert out["wrong"] == [], (r, out["wrong"][:5])
        assert out["votes"] >= 20, (r, out["votes"])
        assert out["worst_s"] < TIMEOUT_S / 2, (r, out["worst_s"])
        assert nonce not in out["name"]  # the repr names the group without its nonce
