"""bench/decode_paths.py end to end on the tiny model (a smoke run, not a measurement)."""

from __future__ import annotations

import json

import pytest


def test_decode_paths_rates_each_round_against_its_own_bandwidth(tmp_path):
    from pdserve.bench.decode_paths import _paths_here, main

    c_paths = [p for p in _paths_here() if p.startswith("c-") and p.count("-") == 1]
    if not c_paths:
        pytest.skip("no C decode step builds here")
    out = tmp_path / "paths.json"
    assert main(["--sizes", "tiny", "--batch", "2", "--paths", c_paths[0], "eager",
                 "--max-tokens", "4", "--rounds", "2", "--result-file", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    bw = row["bandwidth"]
    assert len(bw["read_GBps_per_round"]) == 2 and all(g > 0 for g in bw["read_GBps_per_round"])
    assert min(bw["read_GBps_per_round"]) <= bw["read_GBps"] <= max(bw["read_GBps_per_round"])
    for path in (c_paths[0], "eager"):
        assert len(row["step_ms_per_round"][path]) == 2
        limit = row["weights_once_at_read_bw_ms"][path]
        assert limit > 0 and row["over_weight_read"][path] > 0
        # the paired ratio lies between the rounds' own ratios
        per_round = [s * g / (limit * bw["read_GBps"])
                     for s, g in zip(row["step_ms_per_round"][path], bw["read_GBps_per_round"],
                                     strict=True)]
        assert min(per_round) - 0.01 <= row["over_weight_read"][path] <= max(per_round) + 0.01
    assert row["fastest"] in (c_paths[0], "eager")
    # the C call alone, timed inside the step: shorter than the step, and only C paths
    assert list(row["kernel_ms"]) == [c_paths[0]] == list(row["kernel_over_weight_read"])
    assert 0 < row["kernel_ms"][c_paths[0]] < row["step_ms"][c_paths[0]]
    assert 0 < row["kernel_over_weight_read"][c_paths[0]] < row["over_weight_read"][c_paths[0]]
