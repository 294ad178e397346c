"""Scheduler cost per call: one decode step (schedule + process_outputs) against the
number of running sequences, and one prefill pass against the number of waiting prompts.

    python bench/scheduler.py [--out results/bench_scheduler.json] [--quick]

Pure Python, no device. Each figure is the median of a few repeats, as wall time and as
this process's CPU time (on a shared, oversubscribed host the wall figure includes time
spent waiting for a core; the CPU figure is the cost of the code). The target is judged
on CPU time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from pdserve.scheduler import EngineType, SamplingParams, Scheduler, SchedulerConfig, Sequence

RESULTS_FILE = Path("results") / "bench_scheduler.json"
DECODE_SIZES = (1, 16, 64, 256, 1024)
PREFILL_SIZES = (1, 16, 64, 256)
PROMPT_LEN = 32
BLOCK_SIZE = 16
TARGET_US_PER_SEQ = 2.0  # decode at 256 running sequences


def _decode_scheduler(n: int, steps: int) -> Scheduler:
    per_seq = -(-(PROMPT_LEN + steps + 1) // BLOCK_SIZE) + 1
    config = SchedulerConfig(
        block_size=BLOCK_SIZE, num_blocks=n * per_seq + 1, num_state_slots=n + 1,
        max_model_len=PROMPT_LEN + steps + 64, max_num_seqs=max(n, 1),
        max_num_batched_tokens=max(n, 4096, PROMPT_LEN + steps + 64), stop_preempted_request=True,
        chunked_prefill=False, enable_prefix_caching=False,  # as measured before
    )
    sched = Scheduler(config, EngineType.COMPLETION)
    sampling = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    for i in range(n):
        seq = Sequence(f"r{i}", list(range(1, PROMPT_LEN + 1)), sampling, arrival_time=float(i))
        seq.token_ids.append(7)
        seq.processed = PROMPT_LEN
        sched.add_prefilled(seq)
    out = sched.schedule()  # admission from prompted is not what we time
    sched.process_outputs(out, [7] * len(out.scheduled))
    return sched


def bench_decode(n: int, steps: int, repeats: int) -> dict:
    wall, cpu = [], []
    for _ in range(repeats):
        sched = _decode_scheduler(n, steps)
        tokens = [7] * n
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            out = sched.schedule()
            sched.process_outputs(out, tokens)
        cpu.append((time.process_time() - start_cpu) / steps)
        wall.append((time.perf_counter() - start) / steps)
        assert len(out.scheduled) == n and sched.num_preemptions == 0
    return {"running": n, "steps": steps, **_figures(wall, cpu, n)}


def _figures(wall: list[float], cpu: list[float], n: int) -> dict:
    us, cpu_us = statistics.median(wall) * 1e6, statistics.median(cpu) * 1e6
    return {"us_per_call": us, "us_per_seq": us / n,
            "cpu_us_per_call": cpu_us, "cpu_us_per_seq": cpu_us / n}


def bench_prefill(n: int, repeats: int) -> dict:
    wall, cpu = [], []
    for _ in range(repeats):
        config = SchedulerConfig(
            block_size=BLOCK_SIZE, num_blocks=n * (PROMPT_LEN // BLOCK_SIZE + 1) + 1,
            num_state_slots=n + 1, max_model_len=4096, max_num_seqs=256,
            max_num_batched_tokens=max(4096, n * PROMPT_LEN), chunked_prefill=True,
            enable_prefix_caching=False,  # as measured before
        )
        sched = Scheduler(config, EngineType.PROMPT)
        for i in range(n):
            sched.add(Sequence(f"r{i}", list(range(1, PROMPT_LEN + 1)), arrival_time=float(i)))
        start, start_cpu = time.perf_counter(), time.process_time()
        out = sched.schedule()
        sched.process_outputs(out, [7] * len(out.scheduled))
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
        assert len(out.scheduled) == n
    return {"waiting": n, "prompt_len": PROMPT_LEN, **_figures(wall, cpu, n)}


def _line(n: int, row: dict) -> str:
    return (f"{n:>18} {row['us_per_call']:>10.1f} {row['us_per_seq']:>8.3f} "
            f"{row['cpu_us_per_call']:>12.1f} {row['cpu_us_per_seq']:>11.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_FILE, help=f"JSON file (default {RESULTS_FILE})")
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats (smoke run)")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else 7
    decode, prefill = [], []
    header = f"{'us/call':>10} {'us/seq':>8} {'cpu us/call':>12} {'cpu us/seq':>11}"
    print(f"{'decode: running':>18} {header}")
    for n in DECODE_SIZES:
        steps = max(20, (2_000 if args.quick else 20_000) // n)
        row = bench_decode(n, steps, repeats)
        decode.append(row)
        print(_line(n, row))
    print(f"{'prefill: waiting':>18} {header}")
    for n in PREFILL_SIZES:
        row = bench_prefill(n, repeats * 3)
        prefill.append(row)
        print(_line(n, row))
    row_256 = next(r for r in decode if r["running"] == 256)
    at_256 = row_256["cpu_us_per_seq"]
    verdict = "meets" if at_256 <= TARGET_US_PER_SEQ else "MISSES"
    print(f"decode at 256 running: {at_256:.3f} CPU us/seq, {row_256['us_per_seq']:.3f} wall us/seq "
          f"({verdict} the {TARGET_US_PER_SEQ} us target)")
    report = {
        "python": sys.version.split()[0], "machine": platform.machine(),
        "processor": platform.processor(), "block_size": BLOCK_SIZE,
        "decode": decode, "prefill": prefill,
        "decode_cpu_us_per_seq_at_256": at_256,
        "decode_wall_us_per_seq_at_256": row_256["us_per_seq"], "target_us_per_seq": TARGET_US_PER_SEQ,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"Saved results to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
