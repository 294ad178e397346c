"""bench/scheduler.py runs and writes its JSON (the figures themselves are not asserted:
timings on shared machines are noise-prone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scheduler.py"


def test_bench_scheduler_quick_run_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240, check=True)
    report = json.loads(out.read_text())
    assert [r["running"] for r in report["decode"]] == [1, 16, 64, 256, 1024]
    assert [r["waiting"] for r in report["prefill"]] == [1, 16, 64, 256]
    assert all(r["cpu_us_per_seq"] > 0 and r["us_per_seq"] > 0 for r in report["decode"])
    assert report["decode_cpu_us_per_seq_at_256"] > 0
    assert "decode at 256 running" in done.stdout
