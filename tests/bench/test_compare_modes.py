"""Disaggregated vs normal on the same requests: both deployments really run, and the
side-by-side table is the two results' own numbers."""

from __future__ import annotations

import contextlib
import math
import os
import sys

import pytest

from pdserve.bench.compare_modes import (
    DEPLOYMENTS,
    compare,
    format_interference,
    side_by_side,
)
from pdserve.bench.datasets import mixed_requests
from pdserve.bench.plots import plot_compare
from pdserve.bench.routers import SubprocessRouter, inprocess_router

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 16, "block_size": 16}  # as conftest's


def test_disaggregated_and_normal_side_by_side(router_address, tiny_model_dir, tmp_path):
    reqs = mixed_requests(4, vocab_size=4096, long_ratio=0.25, long_input_len=160,
                          long_output_len=2, short_input_len=16, short_output_len=5, seed=0)
    launchers = {
        # The session's disaggregated router stands in for a fresh one (saves a start-up).
        "disaggregated": contextlib.nullcontext(router_address),
        "normal": inprocess_router(DEPLOYMENTS["normal"], model=tiny_model_dir, engine=ENGINE),
    }
    # Two rounds: both deployments up at once, runs alternating and merged.
    out = compare(launchers, reqs, control=True, rounds=2, request_rate=math.inf,
                  slos={"ttft": 60_000}, progress=False)
    res = out["deployments"]
    for name in ("disaggregated", "normal"):
        r = res[name]
        assert r["completed"] == 8 and r["num_runs"] == 2, r["errors"]
        assert r["cluster"]["mode"] == name
        assert r["output_lens"] == [q.output_len for q in reqs] * 2
    assert res["normal"]["cluster"]["pools"] == {"normal": 2}
    assert res["disaggregated"]["cluster"]["pools"] == {"prefill": 1, "decode": 1}
    table = out["comparison"]
    assert set(table) == {"all", "long", "short"}
    row = table["all"]["p99_itl_ms"]
    assert row["disaggregated"] == res["disaggregated"]["p99_itl_ms"]
    assert row["ratio_normal_to_disaggregated"] == pytest.approx(
        res["normal"]["p99_itl_ms"] / res["disaggregated"]["p99_itl_ms"])
    assert table["short"]["request_goodput"]["normal"] == res["normal"]["by_kind"]["short"][
        "request_goodput"]
    # The control: the 3 short chats alone, in each deployment.
    for name in ("disaggregated", "normal"):
        c = out["controls"][name]
        assert c["completed"] == 6 and set(c["kinds"]) == {"short"}
        row = out["interference"][name]["p99_itl_ms"]
        assert row["with_long"] == res[name]["by_kind"]["short"]["p99_itl_ms"]
        assert row["short_only"] == c["p99_itl_ms"]
        assert row["ratio"] == pytest.approx(row["with_long"] / row["short_only"])
    assert "n/a" not in format_interference(out["interference"])
    png = plot_compare(res, tmp_path / "cmp.png", kind="short",
                       interference=out["interference"])
    assert png.stat().st_size > 10_000


def test_side_by_side_skips_missing_and_zero_baselines():
    results = {"disaggregated": {"p99_itl_ms": 10.0, "request_goodput": None,
                                 "p99_ttft_ms": 0.0},
               "normal": {"p99_itl_ms": 25.0, "request_goodput": 1.0, "p99_ttft_ms": 5.0}}
    t = side_by_side(results)["all"]
    assert t["p99_itl_ms"]["ratio_normal_to_disaggregated"] == 2.5
    assert "ratio_normal_to_disaggregated" not in t["request_goodput"]
    assert "ratio_normal_to_disaggregated" not in t["p99_ttft_ms"]


def test_cli_is_registered():
    from pdserve.cli import build_parser

    args = build_parser().parse_args(["bench", "compare-modes", "--num-prompts", "8"])
    assert args.dataset_name == "mixed" and args.num_prompts == 8
    assert args.launch == "subprocess" and args.goodput == ["ttft:3000", "tpot:150"]
    args = build_parser().parse_args(["bench", "serve", "--goodput", "ttft:5", "tpot:1",
                                      "--request-rate", "2.5", "--burstiness", "0.5"])
    assert args.goodput == ["ttft:5", "tpot:1"] and args.request_rate == 2.5
    args = build_parser().parse_args(["bench", "kv-transfer", "--sizes", "1,256"])
    assert args.sizes == "1,256"
    args = build_parser().parse_args(["bench", "choices", "--n", "8", "--modes", "normal"])
    assert args.n == 8 and args.modes == "normal" and args.repeats == 2
    args = build_parser().parse_args(["bench", "serve", "--dataset-name", "prefix",
                                      "--compare-caching", "--prefix-system-len", "512"])
    assert args.compare_caching and args.prefix_system_len == 512 and args.prefix_turns == 4


def test_cli_brings_up_a_subprocess_router(tiny_model_dir, tmp_path):
    """`pdserve bench compare-modes` end to end: `pdserve serve` in a subprocess with its
    own Ray, loaded, stopped; JSON and PNG written."""
    import json

    from pdserve.bench.compare_modes import main

    out = tmp_path / "cmp.json"
    rc = main(["--model", tiny_model_dir, "--modes", "disaggregated", "--num-prompts", "4",
               "--mixed-long-ratio", "0.25", "--mixed-long-input-len", "100",
               "--mixed-short-output-len", "4", "--request-rate", "inf", "--no-control",
               "--disable-tqdm", "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    d = r["deployments"]["disaggregated"]
    assert d["completed"] == 4 and d["cluster"]["pools"] == {"prefill": 1, "decode": 1}
    assert r["workload"]["launch"] == "subprocess" and "controls" not in r
    assert (tmp_path / "cmp.png").stat().st_size > 10_000


def test_a_router_that_does_not_start_is_reported_and_cleaned_up():
    """Started and waited for apart (overlapping start-ups): a server that exits
    without listening is a RuntimeError carrying its output, and leaves nothing."""
    router = SubprocessRouter([sys.executable, "-c", "print('no model here')"], 30.0).start()
    tmp = router.ray_tmp
    with pytest.raises(RuntimeError, match="no model here"):
        with router:
            pass
    assert router.proc is None and not os.path.exists(tmp)
