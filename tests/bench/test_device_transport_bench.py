"""`bench/device_transport.py` (gpu_check's ``device_transport`` section) on the CPU:
the pair path measured between two real processes against a copy of the same bytes,
the CUDA IPC path said to be skipped, and a rank that fails reported, not waited on."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.bench import device_transport


def test_the_pair_path_is_measured_and_ipc_is_skipped_without_a_gpu():
    out = device_transport.device_transport_check(torch.device("cpu"), reps=1, sizes=(1, 2))
    assert "error" not in out, out
    assert out["pair"]["path"] == "gloo, CPU ranks"
    for size in ("1MiB", "2MiB"):
        row = out["pair"][size]
        assert row["transport_mib_s"] > 0 and row["memcpy_mib_s"] > 0 and row["ms"] > 0
        # computed before the rates were rounded for the JSON
        assert 0 < row["ratio"] == pytest.approx(row["transport_mib_s"] / row["memcpy_mib_s"],
                                                 abs=2e-4)
    assert "CUDA" in out["ipc"]["skipped"]


def test_a_rank_that_fails_is_reported_at_once():
    start = time.monotonic()
    # on CPU the source cannot share by CUDA IPC: the receiver says so and both end
    out = device_transport._run(device_transport._ipc_rank, "cpu", "gloo", (1,), 1)
    assert time.monotonic() - start < 60
    assert "rank 1" in out["error"] and "could not share" in out["error"], out
