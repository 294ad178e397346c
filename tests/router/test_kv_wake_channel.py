"""A direct hand-off's wake-up (kv_transfer/wake_channel.py): a prefill-side process
wakes a decode-side listener with a locator of its own segment; what is not that (another
user, another process's segment, not a locator, too large) is refused and harms nothing;
an import asked twice, by the wake and by the Ray call, runs once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from pdserve.kv_transfer import wake_channel
from pdserve.kv_transfer.shared_memory import SharedPayload, StagingArea
from pdserve.kv_transfer.wake_channel import ImportOnce, WakeListener, WakeSender

pytestmark = pytest.mark.skipif(not (wake_channel.available and StagingArea.available),
                                reason="needs Linux (abstract unix sockets, memfd_create)")

# Another process: exports a real segment and wakes ADDRESS with its locator; "raw" sends
# the bytes given (hex) as they are; "other-pid" a locator naming its parent's segment.
WAKER = textwrap.dedent("""
    import os, socket, sys
    from pdserve.kv_transfer.shared_memory import SharedPayload, StagingArea
    from pdserve.kv_transfer.wake_channel import WakeSender
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
