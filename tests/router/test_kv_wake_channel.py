"""A direct hand-off's wake-up (kv_transfer/ray/wake_channel.py): a prefill-side process
wakes a decode-side listener with a locator of its own segment; what is not that (another
user, another process's segment, not a locator, too large) is refused and harms nothing;
an import asked twice, by the wake and by the Ray call, runs once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pdserve.kv_transfer.base import DeliveryResult
from pdserve.kv_transfer.ray import wake_channel
from pdserve.kv_transfer.ray.shared_memory import SharedPayload, StagingArea
from pdserve.kv_transfer.ray.wake_channel import (
    LISTEN_PREFIX,
    ImportOnce,
    LocalImports,
    WakeListener,
    WakeSender,
)

pytestmark = pytest.mark.skipif(not (wake_channel.available and StagingArea.available),
                                reason="needs Linux (abstract unix sockets, memfd_create)")

# Another process: exports a real segment and wakes ADDRESS with its locator; "raw" sends
# the bytes given (hex) as they are; "other-pid" a locator naming its parent's segment.
WAKER = textwrap.dedent("""
    import os, socket, sys
    from pdserve.kv_transfer.ray.shared_memory import SharedPayload, StagingArea
    from pdserve.kv_transfer.ray.wake_channel import WakeSender
    address = bytes.fromhex(sys.argv[1]).decode()
    area = StagingArea(4 << 20, node_id="n")
    area.lend("a", 1000)
    locator = area.export("a")
    sender = WakeSender()
    for cmd in sys.argv[2:]:
        if cmd == "own":
            ok = sender.wake(address, locator)
        elif cmd == "other-pid":
            ok = sender.wake(address, SharedPayload("n", os.getppid(), 3, 4, 5, 6))
        else:  # raw bytes
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.sendto(bytes.fromhex(cmd), address)
            ok = True
        print(int(ok), flush=True)
    print(repr(locator.as_tuple()), flush=True)
""")


def run_waker(address: str, *cmds: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", WAKER, address.encode().hex(), *cmds],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split("\n")


@pytest.fixture
def listener():
    woken: list[SharedPayload] = []
    arrived = threading.Condition()

    def on_wake(locator):
        with arrived:
            woken.append(locator)
            arrived.notify_all()

    lis = WakeListener(on_wake)

    def wait_for(n: int, timeout_s: float = 10.0) -> list[SharedPayload]:
        with arrived:
            arrived.wait_for(lambda: len(woken) >= n, timeout_s)
            return list(woken)

    lis.wait_for = wait_for
    yield lis
    lis.close()


def test_a_process_wakes_the_listener_with_its_own_segments_locator(listener):
    lines = run_waker(listener.address, "own", "own")
    assert lines[:2] == ["1", "1"]
    sent = SharedPayload.of(eval(lines[2]))  # its own repr of plain values
    woken = listener.wait_for(2)
    assert woken == [sent, sent] and listener.num_refused == 0
    assert sent.pid != os.getpid() and sent.nbytes == 1000


def test_what_is_not_a_senders_own_locator_is_refused_and_the_listener_goes_on(listener):
    too_large = b"[" + b"1," * 400 + b"1]"
    lines = run_waker(listener.address, "other-pid", b"not json".hex(), b'["n",1,2]'.hex(),
                      too_large.hex(), "own")
    sent = SharedPayload.of(eval(lines[5]))
    assert listener.wait_for(1) == [sent]  # only its own segment's, after the rest
    deadline = time.monotonic() + 5
    while listener.num_refused < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener.num_refused == 4 and listener.num_woken == 1


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to send as another user")
def test_a_datagram_from_another_user_is_refused(listener):
    # a child that becomes another user and names a segment of its own: the right
    # process, the wrong user (forked: that user cannot read this interpreter's files)
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(65534)
            WakeSender().wake(listener.address, SharedPayload("n", os.getpid(), 3, 4, 5, 6))
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    deadline = time.monotonic() + 5
    while listener.num_refused < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener.num_refused == 1 and listener.wait_for(1, timeout_s=0.2) == []


def test_a_wake_to_nobody_fails_at_once_and_a_closed_listener_stops():
    sender = WakeSender()
    locator = SharedPayload("n", os.getpid(), 3, 4, 5, 6)
    lis = WakeListener(lambda locator: None)
    address = lis.address
    lis.close()
    start = time.monotonic()
    assert not sender.wake(address, locator)  # nobody listens there now
    assert not sender.wake("/tmp/not-a-wake-address", locator)
    assert time.monotonic() - start < 1.0 and sender.num_failed == 1
    assert not lis._thread.is_alive()
    sender.close()


def test_an_import_asked_by_a_wake_and_by_the_call_runs_once():
    once, runs = ImportOnce(), []

    def run(tag):
        def go():
            runs.append(tag)
            return f"result of {tag}"
        return go

    def timed_out():
        return "timed out"

    # wake first: the call answers the wake's result
    assert once.woken("k1", run("wake"))
    assert once.called("k1", run("call"), 5.0, timed_out) == "result of wake"
    # the call first: a late wake is ignored
    assert once.called("k2", run("call2"), 5.0, timed_out) == "result of call2"
    assert not once.woken("k2", run("late wake"))
    assert runs == ["wake", "call2"] and len(once) == 0 and once.num_shared == 1

    # a call while the wake's import runs waits for it, and past its wait gives up
    release = threading.Event()

    def slow():
        release.wait(10)
        return "slow result"

    thread = threading.Thread(target=once.woken, args=("k3", slow))
    thread.start()
    time.sleep(0.05)
    assert once.called("k3", run("never"), 0.05, timed_out) == "timed out"
    waiter: list = []
    t2 = threading.Thread(target=lambda: waiter.append(once.called("k3", run("never"), 10,
                                                                  timed_out)))
    t2.start()
    release.set()
    thread.join(5)
    t2.join(5)
    assert waiter == ["slow result"] and "never" not in runs


def test_results_nobody_collects_expire():
    once = ImportOnce(max_entries=4, max_age_s=0.05)
    for i in range(3):
        assert once.woken(f"k{i}", lambda: "r")
    time.sleep(0.1)
    assert once.woken("k9", lambda: "r")  # expires the old ones as it adds
    assert len(once) == 1
    for i in range(20):
        once.woken(f"m{i}", lambda: "r")
    assert len(once) <= 4


# ---- the router's side: imports asked and answered through the channel ----------------

def _answering_listener(answers: list):
    """A listener whose imports answer ImportResults naming the locator's generation."""
    from pdserve.rank.messages import ImportResult

    def on_import(locator, skip):
        answers.append((locator, skip))
        if locator.generation == 99:
            return ImportResult(False, kind="capacity", error="x" * 5000)  # cut in the reply
        return ImportResult(True, attempt=f"a{locator.generation}", nbytes=locator.nbytes - skip)

    return WakeListener(lambda locator: None, on_import)


def test_the_router_asks_an_import_and_reads_the_answer():
    answers: list = []
    lis = _answering_listener(answers)
    imports = LocalImports()

    async def run():
        loc = SharedPayload("n", os.getpid(), 3, 4, 5, 1000)
        ok = await imports.request(lis.address, loc, 2, os.getpid(), lambda: True)
        refused = await imports.request(lis.address, SharedPayload("n", 1, 3, 4, 99, 10), 0,
                                        os.getpid(), lambda: True)
        nobody = await imports.request(LISTEN_PREFIX + "gone", loc, 0, os.getpid(), lambda: True)
        return ok, refused, nobody

    try:
        ok, refused, nobody = asyncio.run(asyncio.wait_for(run(), 10))
    finally:
        imports.close()
        lis.close()
    assert ok == DeliveryResult(True, attempt="a5", nbytes=998)
    assert not refused.ok and refused.kind == "capacity" and len(refused.error) == 2000
    assert nobody is None  # not sent: the caller makes the Ray call
    assert [skip for _, skip in answers] == [2, 0] and lis.num_imports == 2


def test_a_rank_that_dies_while_asked_fails_the_request_at_once():
    stuck = threading.Event()
    lis = WakeListener(lambda locator: None, lambda locator, skip: stuck.wait(30))
    imports, alive = LocalImports(), [True]

    async def run():
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, alive.clear)
        start = time.monotonic()
        result = await imports.request(lis.address, SharedPayload("n", 1, 3, 4, 5, 6), 0,
                                       os.getpid(), lambda: bool(alive))
        return result, time.monotonic() - start

    try:
        result, took = asyncio.run(asyncio.wait_for(run(), 10))
    finally:
        imports.close()
        stuck.set()
        lis.close()
    assert not result.ok and result.kind == "transport" and "died" in result.error
    assert took < 2.0 and len(imports._pending) == 0


# Another process answers an expected id as if it were the decode rank (it is not).
FORGER = textwrap.dedent("""
    import json, socket, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(json.dumps({"id": sys.argv[2], "ok": True, "attempt": "forged", "kind": "",
                         "error": "", "nbytes": 1}).encode(), bytes.fromhex(sys.argv[1]).decode())
""")


def test_a_woken_import_answers_the_router_and_a_forged_answer_is_refused():
    """A direct hand-off with a reply: the prefill rank's wake names the id the router
    expects; only the decode rank's own answer counts, one from any other process (same
    user) is refused."""
    answers: list = []
    lis = _answering_listener(answers)
    imports = LocalImports()

    async def run():
        rid = imports.expect(os.getpid())  # the listener answers from this process
        other = imports.expect(os.getpid())
        subprocess.run([sys.executable, "-c", FORGER, imports.address.encode().hex(), other],
                       check=True, timeout=60)
        loc = SharedPayload("n", os.getpid(), 3, 4, 7, 100)
        assert WakeSender().wake(lis.address, loc, imports.address, rid)
        got = await asyncio.wait_for(imports.answer(rid, lambda: True), 10)
        forged = asyncio.ensure_future(imports.answer(other, lambda: True))
        await asyncio.sleep(0.3)
        assert not forged.done()  # the forged answer did not count
        imports.forget(other)
        return got, await forged, await imports.answer("never-expected", lambda: True)

    try:
        got, forgotten, unknown = asyncio.run(run())
    finally:
        imports.close()
        lis.close()
    assert got == DeliveryResult(True, attempt="a7", nbytes=100) and lis.num_woken == 1
    assert imports.num_refused >= 1
    assert not forgotten.ok and "called off" in forgotten.error
    assert not unknown.ok and unknown.kind == "transport"
