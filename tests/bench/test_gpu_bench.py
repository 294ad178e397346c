"""``pdserve bench gpu`` end to end on the CPU with its smallest shape: a model folder is
made from the shape, served, measured against the roofline, and written as JSON."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench import gpu


def test_bench_gpu_on_cpu_smoke_shape(tmp_path, capsys):
    out = tmp_path / "bench.json"
    p = argparse.ArgumentParser()
    gpu.add_args(p)
    args = p.parse_args(["--device", "cpu", "--shapes", "cpu-smoke", "--batches", "1,3",
                         "--out", "6", "--prefill", "2x40", "--no-hf", "--json", str(out),
                         "--models", str(tmp_path / "models")])
    assert gpu.run(args) == 0
    rows = json.loads(out.read_text())
    decode = [r for r in rows if r["what"] == "decode"]
    assert [r["batch"] for r in decode] == [1, 3]
    for r in decode:
        assert r["pdserve_tok_s"] > 0 and 0 < r["pdserve_vs_roofline"] < 1
    # the roofline grows with the batch (weights read once for all rows)
    assert decode[1]["roofline_tok_s"] > 2 * decode[0]["roofline_tok_s"]
    load = next(r for r in rows if r["what"] == "load")
    assert load["backend"] == "cpu"  # the CPU's default
    assert next(r for r in rows if r["what"] == "prefill")["prompt_tok_s"] > 0
    assert "cpu-smoke" in capsys.readouterr().out  # the table
    assert not (tmp_path / "models" / "cpu-smoke").exists()  # the made model is removed


def test_unknown_shape_is_refused(tmp_path):
    p = argparse.ArgumentParser()
    gpu.add_args(p)
    with pytest.raises(SystemExit, match="unknown shape 'llama-70b'"):
        gpu.run(p.parse_args(["--device", "cpu", "--shapes", "llama-70b",
                              "--json", str(tmp_path / "x.json")]))
