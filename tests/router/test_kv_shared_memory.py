"""The ray transport's shared-memory path: segments lent by a sender process, mapped by
a receiver process, reused warm, refused once released, freed with their process."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from pdserve.engine.kv.payload import ALIGN, KVPayload
from pdserve.kv_transfer.ray.shared_memory import (
    SharedPayload,
    SharedPayloadReader,
    SharedPayloadUnavailable,
    StagingArea,
)

pytestmark = pytest.mark.skipif(not StagingArea.available, reason="needs memfd_create (Linux)")

MIB = 1 << 20

# A sender in its own process: lends a segment per line it reads, fills it with that
# line's byte, exports it and prints the pickled locator (hex); "release X" frees X.
SENDER = textwrap.dedent("""
    import pickle, sys
    from pdserve.kv_transfer.ray.shared_memory import StagingArea
    area = StagingArea(8 << 20, node_id="n")
    for line in sys.stdin:
        cmd, attempt, *rest = line.split()
        if cmd == "lend":
            view = area.lend(attempt, int(rest[0]))
            view[:] = bytes([int(rest[1])]) * len(view)
            print(pickle.dumps(area.export(attempt)).hex(), flush=True)
        elif cmd == "release":
            area.release(attempt)
            print("ok", flush=True)
""")


@pytest.fixture
def sender():
    proc = subprocess.Popen([sys.executable, "-c", SENDER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)

    def ask(line: str):
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline().strip()
        return pickle.loads(bytes.fromhex(answer)) if answer != "ok" else answer

    ask.proc = proc
    yield ask
    proc.kill()
    proc.wait()


def test_a_receiver_process_reads_the_senders_bytes_and_refuses_them_once_released(sender):
    reader = SharedPayloadReader()
    first = sender("lend a 3000000 7")
    assert first.pid == sender.proc.pid and first.nbytes == 3_000_000
    view = reader.open(first)
    assert view.readonly and len(view) == 3_000_000 and bytes(view[:4]) == b"\x07" * 4
    assert view[-1] == 7 and reader.still_valid(first)
    del view

    assert sender("release a") == "ok"
    assert not reader.still_valid(first)  # a copy that raced the release is refused
    with pytest.raises(SharedPayloadUnavailable, match="reused"):
        reader.open(first)

    second = sender("lend b 2500000 9")  # the warm segment again, a new generation
    assert (second.fd, second.inode) == (first.fd, first.inode)
    assert second.generation > first.generation
    assert bytes(reader.open(second)[:2]) == b"\x09\x09"


def test_a_dead_senders_segments_cannot_be_opened(sender):
    locator = sender("lend a 1000 1")
    sender.proc.kill()
    sender.proc.wait()
    with pytest.raises(SharedPayloadUnavailable):
        SharedPayloadReader().open(locator)


def test_lending_stays_within_capacity_and_takes_back_what_was_never_exported():
    area = StagingArea(4 * MIB)
    try:
        a = area.lend("a", 3 * MIB)
        assert a is not None and not a.readonly
        assert area.lend("b", 3 * MIB) is None  # no room: the caller uses its own buffer
        area.forget_unexported()  # "a"'s export failed: its segment goes back
        assert len(area) == 0
        b = area.lend("b", 3 * MIB)
        assert b is not None and area.export("b") is not None
        area.forget_unexported()  # an exported payload stays until released
        assert len(area) == 1 and 3 * MIB < area.bytes_held <= 4 * MIB
        assert area.lend("c", 8 * MIB) is None  # larger than the whole area
        area.release("b")
        assert len(area) == 0 and area.lend("c", 100) is not None
        assert area.bytes_held <= 4 * MIB
    finally:
        area.close()


def test_a_payload_that_fills_most_of_the_area_and_many_chunks_are_staged():
    """A rank's staging area holds what its KV cache holds: a prompt that fills most of
    the cache, or its chunks streamed ahead, all stay in shared memory."""
    from pdserve.kv_transfer.ray.shared_memory import segment_size

    for need in (1, MIB, 2 * MIB + 40_000, 16 * MIB + 70_000, 255 * MIB):
        assert need <= segment_size(need) <= max(MIB, need * 1.125)
    area = StagingArea(20 * MIB)  # a 320-block cache of 64 KiB blocks
    try:
        assert area.lend("whole", 16 * MIB + 70_000) is not None
        area.release("whole")
        # a prompt of 19 of its 20 MiB: no rounding that would take it past the area
        assert area.lend("whole", 19 * MIB + 130_000) is not None
        area.release("whole")
        area.close()  # its segments go: the chunks below make their own
        for i in range(8):  # a 4096-token prompt's chunks of 512 tokens and their headers
            assert area.lend(f"chunk-{i}", 2 * MIB + 4096 * (i + 1)) is not None, i
            assert area.export(f"chunk-{i}") is not None
        assert area.bytes_held <= 20 * MIB
    finally:
        area.close()


def test_a_payload_is_laid_out_aligned_and_read_back_as_views_of_its_bytes():
    k = torch.randn(2, 3, 4, 2, 8)
    payload = KVPayload("r", "fp", "float32", 4, 2, [1, 2, 3], 2, {},
                        tensors={"k_blocks": k, "v_blocks": k + 1})
    layout = payload.layout({n: (t.dtype, tuple(t.shape)) for n, t in payload.tensors.items()})
    assert len(layout.head) % ALIGN == 0
    area = StagingArea(4 * MIB)
    try:
        buffer = area.lend("r", layout.nbytes)
        views = layout.write(buffer)
        views["k_blocks"].copy_(k)
        views["v_blocks"].copy_(k + 1)
        locator = area.export("r")
        mapped = SharedPayloadReader().open(locator)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a read-only buffer must not warn either
            back = KVPayload.from_bytes(mapped)
        assert torch.equal(back.tensors["k_blocks"], k)
        assert torch.equal(back.tensors["v_blocks"], k + 1)
        address = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
        assert back.tensors["k_blocks"].data_ptr() == address + len(layout.head)  # no copy
        assert back.tensors["k_blocks"].data_ptr() % ALIGN == 0
    finally:
        area.close()


def test_a_reader_keeps_its_mappings_bounded():
    area = StagingArea(64 * MIB)
    reader = SharedPayloadReader(max_mapped_bytes=3 * MIB)
    try:
        locators = []
        for i in range(4):
            area.lend(str(i), MIB - 64)
            locators.append(area.export(str(i)))
        for locator in locators:
            reader.open(locator)
        assert sum(len(m) for m in reader._maps.values()) <= 3 * MIB
        assert reader.open(locators[0])  # evicted ones map again
    finally:
        area.close()
        reader.close()



def test_a_locator_travels_as_plain_values_and_anything_else_is_refused(sender):
    """What deliver sends through Ray (msgpack turns the tuple into a list)."""
    locator = sender("lend a 2000 5")
    reader = SharedPayloadReader()
    for form in (locator.as_tuple(), list(locator.as_tuple())):
        assert SharedPayload.of(form) == locator
        assert bytes(reader.open(form)[:3]) == b"\x05" * 3 and reader.still_valid(form)
    for bad in (None, "x", (1, 2), [*locator.as_tuple()[:5], "7"], (7, *locator.as_tuple()[1:]),
                [*locator.as_tuple()[:5], True]):
        with pytest.raises(SharedPayloadUnavailable):
            reader.open(bad)
        assert not reader.still_valid(bad)
