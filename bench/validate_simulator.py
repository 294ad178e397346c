"""The simulator against measured runs: p50 and p99 TTFT and ITL, side by side.

    python bench/validate_simulator.py                          # 1P+1D and 2P+1D, 3 workloads
    python bench/validate_simulator.py --deployments 1p1d --num-prompts 40

Per deployment, a real `pdserve serve` (embedded Ray, the built-in tiny model) serves
each workload through `pdserve bench serve` (its `--timeline` records every engine
step); then `pdserve simulate` runs the same seeded workload on the same deployment,
twice: with the built-in cost model (`simulator/tiny_cpu.json`) and with costs fitted
(`--fit-from`) to the *mixed* workload's measured timeline, the calibration run. So
the other workloads' errors are out of sample for the fitted model. Workloads:

  short    short chats (random 64-token prompts, 32 tokens out) at 4 req/s
  mixed    mixed long prompts (`--dataset-name mixed`: 10% of 1024 tokens) at 2 req/s
  sweep@R  the short chats at each rate of `--sweep-rates` (default 2, 8, inf)

Prints one table (measured, simulated, error as simulated / measured - 1) and writes
JSON (default results/bench_validate_simulator.json) with every run's summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.routers import subprocess_router
from pdserve.bench.serve_report import write_json

DEPLOYMENTS = {"1p1d": {"mode": "disaggregated", "prefill": 1, "decode": 1},
               "2p1d": {"mode": "disaggregated", "prefill": 2, "decode": 1}}
SHORT = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "32"]
MIXED = ["--dataset-name", "mixed"]
CALIBRATION = "mixed"
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def workloads(sweep_rates: list[str]) -> dict[str, list[str]]:
    out = {"short": [*SHORT, "--request-rate", "4"], "mixed": [*MIXED, "--request-rate", "2"]}
    for rate in sweep_rates:
        out[f"sweep@{rate}"] = [*SHORT, "--request-rate", rate]
    return out


def _pdserve(*args: str, timeout_s: float) -> None:
    cmd = [sys.executable, "-m", "pdserve.cli", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"`pdserve {' '.join(args[:2])}` failed ({done.returncode}):\n"
                           + (done.stdout + done.stderr)[-3000:])


def timeline_of(result: Path) -> Path:
    """Where bench serve's --timeline leaves a run's step records (FILE.png -> FILE.json)."""
    return result.with_name(result.stem + "-timeline.json")


def measure(address: str, load: list[str], common: list[str], out: Path, timeout_s: float) -> dict:
    _pdserve("bench", "serve", "--address", address, *load, *common, "--no-plot",
             "--disable-tqdm", "--result-file", str(out), "--timeline", str(timeline_of(out).with_suffix(".png")),
             timeout_s=timeout_s)
    return json.loads(out.read_text())


def simulate(spec: dict, load: list[str], common: list[str], out: Path, timeline: Path | None,
             timeout_s: float) -> dict:
    fit = ["--fit-from", str(timeline)] if timeline else []
    _pdserve("simulate", "--mode", spec["mode"], "--prefill", str(spec["prefill"]),
             "--decode", str(spec["decode"]), *load, *common, *fit, "--disable-tqdm",
             "--summary-only", "--result-file", str(out), timeout_s=timeout_s)
    return json.loads(out.read_text())


def error(simulated: float | None, measured: float | None) -> float | None:
    if simulated is None or not measured:
        return None
    return round(simulated / measured - 1.0, 3)


def format_table(rows: list[dict]) -> str:
    head = f"{'deployment':>10} {'workload':>10} {'metric':>15} {'measured':>9} " \
           f"{'sim built-in':>12} {'err':>7} {'sim fitted':>10} {'err':>7}"
    lines = [head]
    for r in rows:
        def cell(v, w, fmt="{:.1f}"):
            return f"{'-' if v is None else fmt.format(v):>{w}}"
        lines.append(f"{r['deployment']:>10} {r['workload']:>10} {r['metric']:>15} "
                     f"{cell(r['measured'], 9)} {cell(r['builtin'], 12)} "
                     f"{cell(r['builtin_error'], 7, '{:+.0%}')} {cell(r['fitted'], 10)} "
                     f"{cell(r['fitted_error'], 7, '{:+.0%}')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=list(DEPLOYMENTS))
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-rates", nargs="+", default=["2", "8", "inf"])
    p.add_argument("--timeout-s", type=float, default=900.0, help="per measured run")
    p.add_argument("--result-file", default="results/bench_validate_simulator.json")
    args = p.parse_args(argv)

    loads = workloads(args.sweep_rates)
    order = [CALIBRATION, *[w for w in loads if w != CALIBRATION]]
    common = ["--num-prompts", str(args.num_prompts), "--seed", str(args.seed)]
    runs: dict = {}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-validate-") as root:
        for name in args.deployments:
            spec = DEPLOYMENTS[name]
            runs[name] = {}
            t0 = time.perf_counter()
            with subprocess_router(spec) as address:
                for w in order:
                    out = Path(root) / f"{name}-{w}.json"
                    runs[name][w] = {"measured": measure(address, loads[w], common, out,
                                                         args.timeout_s)}
                    print(f"{name} {w}: measured ({time.perf_counter() - t0:.0f} s)",
                          file=sys.stderr, flush=True)
            timeline = timeline_of(Path(root) / f"{name}-{CALIBRATION}.json")
            for w in order:
                base = Path(root) / f"{name}-{w}-sim"
                sim = runs[name][w]
                sim["builtin"] = simulate(spec, loads[w], common, base.with_suffix(".b.json"),
                                          None, args.timeout_s)
                sim["fitted"] = simulate(spec, loads[w], common, base.with_suffix(".f.json"),
                                         timeline, args.timeout_s)
                for m in METRICS:
                    got = {k: sim[k].get(m) for k in ("measured", "builtin", "fitted")}
                    rows.append({"deployment": name, "workload": w, "metric": m, **got,
                                 "builtin_error": error(got["builtin"], got["measured"]),
                                 "fitted_error": error(got["fitted"], got["measured"])})
            print(format_table([r for r in rows if r["deployment"] == name]), flush=True)
    for name in runs:  # summaries only: the per-request lists are large
        for w in runs[name]:
            for kind, r in runs[name][w].items():
                runs[name][w][kind] = {k: v for k, v in r.items() if not isinstance(v, list)}

    out = write_json(args.result_file, {"benchmark": "validate_simulator",
                                        "num_prompts": args.num_prompts,
                                        "calibration": CALIBRATION, "rows": rows, "runs": runs})
    print(format_table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
