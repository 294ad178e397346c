"""TorchDistCommunicator over gloo, in real processes: results, re-forming, timeouts."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time

import pytest
import torch

from pdserve.engine.dp_comm import CollectiveError, TorchDistCommunicator
from pdserve.engine.rank_pool import DeadRank, RankError, run_ranks
from pdserve.scheduler.votes import Communicator


def value(step: int, rank: int) -> int:
    """A deterministic value per (step, rank), negative ones included."""
    return (step * 7919 + rank * 104729) % 23 - 5


def _reduce_many(ctx, steps, world_size=None, rank=None, name="g"):
    ws = ctx.world_size if world_size is None else world_size
    r = ctx.rank if rank is None else rank
    comm = ctx.communicator(name, rank=r, world_size=ws)
    try:
        got = [comm.all_reduce_min(value(s, r)) for s in range(steps)]
        return {"got": got, "calls": comm.calls, "rank": comm.rank, "world_size": comm.world_size}
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_min_matches_the_minimum(rank_pool, world_size):
    steps = 50
    out = rank_pool.run(_reduce_many, steps, world_size=world_size,
                        ranks=list(range(world_size)))
    expected = [min(value(s, r) for r in range(world_size)) for s in range(steps)]
    for r, res in enumerate(out):
        assert res == {"got": expected, "calls": steps, "rank": r, "world_size": world_size}


def _reform(ctx):
    """One group of 4, then (same processes) two disjoint groups of 2 side by side, then
    a group of 3 that renumbers ranks 1..3 as 0..2; finally two groups alive at once."""
    log = {}
    big = ctx.communicator("four")
    log["four"] = [big.all_reduce_min(value(s, ctx.rank)) for s in range(5)]
    big.close()
    with pytest.raises(CollectiveError, match="closed"):
        big.all_reduce_min(0)
    pair, local = divmod(ctx.rank, 2)  # ranks {0,1} and {2,3}
    with ctx.communicator(f"pair{pair}", rank=local, world_size=2) as comm:
        log["pair"] = [comm.all_reduce_min(value(s, ctx.rank)) for s in range(5)]
    if ctx.rank >= 1:
        with ctx.communicator("three", rank=ctx.rank - 1, world_size=3) as comm:
            log["three"] = [comm.all_reduce_min(value(s, ctx.rank)) for s in range(5)]
    # Two groups in one process at once, used in interleaved order.
    a = ctx.communicator("a")
    b = ctx.communicator(f"b{pair}", rank=local, world_size=2)
    log["ab"] = [(a.all_reduce_min(ctx.rank), b.all_reduce_min(-ctx.rank)) for _ in range(3)]
    log["calls"] = (a.calls, b.calls)
    a.close()
    b.close()
    return log


def test_reform_groups_with_other_world_sizes_in_the_same_processes(rank_pool):
    out = rank_pool.run(_reform)
    for r, log in enumerate(out):
        assert log["four"] == [min(value(s, q) for q in range(4)) for s in range(5)]
        peers = (0, 1) if r < 2 else (2, 3)
        assert log["pair"] == [min(value(s, q) for q in peers) for s in range(5)]
        if r >= 1:
            assert log["three"] == [min(value(s, q) for q in (1, 2, 3)) for s in range(5)]
        else:
            assert "three" not in log
        assert log["ab"] == [(0, -peers[1])] * 3
        assert log["calls"] == (3, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_address(ctx, addresses):
    """Rank 0 hosts the store at each address; a resize moves to a fresh address."""
    out = []
    for address, ws in addresses:
        if ctx.rank >= ws:
            continue
        with TorchDistCommunicator(ctx.rank, ws, address, timeout=10.0) as comm:
            out.append([comm.all_reduce_min(10 * ctx.rank + s) for s in range(3)])
    return out


def test_tcp_address_init_and_resize(rank_pool):
    plan = [(f"tcp://127.0.0.1:{_free_port()}", 3), (f"tcp://127.0.0.1:{_free_port()}", 2)]
    out = rank_pool.run(_by_address, plan, ranks=[0, 1, 2])
    assert out[0] == out[1] == [[0, 1, 2], [0, 1, 2]]
    assert out[2] == [[0, 1, 2]]


def _hang_then_die(ctx, timeout):
    """Rank 1 first stops taking part (alive, hung), then dies; rank 0 must raise."""
    report = {}
    comm = ctx.communicator("hang", timeout=timeout)
    assert comm.all_reduce_min(ctx.rank) == 0
    done_key = f"run{ctx.task_id}/hang-over"
    if ctx.rank == 1:
        time.sleep(timeout + 1.5)  # rank 0 times out meanwhile
        comm.close()
        ctx.store.set(done_key, b"1")
    else:
        start = time.monotonic()
        try:
            comm.all_reduce_min(0)
            report["hung_peer"] = "no error"
        except CollectiveError as e:
            report["hung_peer"] = time.monotonic() - start
            report["hung_message"] = str(e)
        with pytest.raises(CollectiveError, match="failed earlier"):
            comm.all_reduce_min(0)  # a failed group stays failed
        comm.close()
        ctx.store.wait([done_key], datetime.timedelta(seconds=30))  # rank 1 is back
    comm = ctx.communicator("die", timeout=timeout)
    assert comm.all_reduce_min(ctx.rank) == 0
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce_min(0)
        report["dead_peer"] = "no error"
    except CollectiveError:
        report["dead_peer"] = time.monotonic() - start
    comm.close()
    return report


def test_dead_or_hung_peer_raises_within_the_timeout():
    timeout = 2.0
    out = run_ranks(_hang_then_die, 2, timeout, timeout=60, allow_dead=True)
    assert isinstance(out[1], DeadRank) and out[1].exitcode == -signal.SIGKILL
    report = out[0]
    assert isinstance(report["hung_peer"], float), report
    assert timeout * 0.8 <= report["hung_peer"] <= timeout + 3.0
    assert "rank 0/2" in report["hung_message"]
    assert isinstance(report["dead_peer"], float), report
    assert report["dead_peer"] <= timeout + 3.0


def _raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    return ctx.rank


def _unpicklable(ctx):
    return lambda: ctx.rank


def test_pool_reports_a_rank_exception_and_stays_usable(rank_pool):
    with pytest.raises(RankError, match="boom on purpose"):
        rank_pool.run(_raise_on_rank_1, ranks=[0, 1])
    with pytest.raises(RankError, match="cannot be pickled"):
        rank_pool.run(_unpicklable, ranks=[2], timeout=20)
    with pytest.raises(ValueError, match="module-level"):
        rank_pool.run(lambda ctx: 0)
    assert rank_pool.run(_raise_on_rank_1, ranks=[0, 2, 3]) == [0, 2, 3]


def test_single_rank_needs_no_peers():
    comm = TorchDistCommunicator(0, 1)
    assert isinstance(comm, Communicator)  # the scheduler's protocol (scheduler/votes.py)
    assert [comm.all_reduce_min(v) for v in (3, -2, 7)] == [3, -2, 7]
    assert comm.calls == 3 and comm.backend == "gloo"
    comm.close()
    with pytest.raises(CollectiveError):
        comm.all_reduce_min(1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=2, world_size=2), "rank must be in"),
    (dict(rank=0, world_size=0), "world_size"),
    (dict(rank=0, world_size=2), "needs init"),
    (dict(rank=0, world_size=2, init="127.0.0.1:1234"), "tcp://HOST:PORT"),
    (dict(rank=0, world_size=1, backend="mpi"), "backend"),
    (dict(rank=0, world_size=1, timeout=0), "timeout"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TorchDistCommunicator(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_nccl_needs_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA"):
        TorchDistCommunicator(0, 1, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_single_rank_on_a_gpu():  # pragma: no cover - GPU only
    port = _free_port()
    comm = TorchDistCommunicator(0, 1, f"tcp://127.0.0.1:{port}", device="cuda")
    assert comm.backend == "nccl" and comm.all_reduce_min(5) == 5
    comm.close()


def _abort_while_a_peer_hangs(ctx, timeout):
    """Rank 2 hangs (alive, out of the vote); rank 0 is told its peer is dead while it
    waits in the vote; rank 1 is not told and waits for the timeout."""
    import threading

    comm = ctx.communicator("abort", timeout=timeout)
    assert comm.all_reduce_min(ctx.rank) == 0
    if ctx.rank == 2:
        time.sleep(timeout + 1.0)
        comm.close()
        return {}
    if ctx.rank == 0:
        threading.Timer(0.5, comm.abort, args=("rank 2 died",)).start()
    start = time.monotonic()
    with pytest.raises(CollectiveError) as raised:
        comm.all_reduce_min(0)
    waited = time.monotonic() - start
    start = time.monotonic()
    comm.close()  # the aborted work is still running in gloo: close must not wait for it
    return {"waited": waited, "error": str(raised.value), "close": time.monotonic() - start}


def test_abort_releases_a_vote_waiting_for_a_hung_peer_at_once():
    timeout = 4.0
    out = run_ranks(_abort_while_a_peer_hangs, 3, timeout, timeout=60)
    told, untold = out[0], out[1]
    assert 0.4 <= told["waited"] < 1.5, told
    assert "aborted: rank 2 died" in told["error"]
    assert told["close"] < 0.5, told
    assert timeout * 0.8 <= untold["waited"] <= timeout + 3.0, untold
    assert "timed out" in untold["error"].lower() or "closed" in untold["error"].lower(), untold
