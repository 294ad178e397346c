"""Lab 12: which running request gives up its blocks when the pool runs out?

Reproduces section 5.3 of the chapter with the project's real scheduler and block
pool: A, B and C own every usable block, B and C need one more for their next token,
and one decode pass runs under three preemption settings (recompute, stop flag,
active structured output).

    python labs/12_preempt.py
    python labs/12_preempt.py --scenario my_scenario.json

A scenario is JSON: {"block_size", "num_blocks", "running": [{"name", "prompt_len",
"output_len", "processed"}], "waiting": [{"name", "prompt_len"}], "cases": [{"stop",
"so": {name: so_status}}]}. Running sequences are allocated in listed order, each
holding ceil(processed / block_size) blocks and one state slot; every case starts
from that state. The text is printed and written to ``results/12_preempt.txt``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve.scheduler import EngineType, Scheduler, SchedulerConfig, Sequence
from pdserve.scheduler.decode_path import decode_priority

RESULTS_FILE = Path("results") / "12_preempt.txt"

CHAPTER_SCENARIO = {
    "block_size": 4,
    "num_blocks": 20,
    "running": [
        {"name": "A", "prompt_len": 12, "output_len": 8, "processed": 19},
        {"name": "B", "prompt_len": 43, "output_len": 2, "processed": 44},
        {"name": "C", "prompt_len": 9, "output_len": 4, "processed": 12},
    ],
    "waiting": [{"name": "D", "prompt_len": 6}],
    "cases": [
        {"stop": False, "so": {"A": 0}},
        {"stop": True, "so": {"A": 0}},
        {"stop": False, "so": {"A": 1}},
    ],
}


def build(scenario: dict, stop: bool) -> tuple[Scheduler, list[Sequence]]:
    """A NORMAL engine whose running sequences own their blocks, mid-decode."""
    running, waiting = scenario["running"], scenario.get("waiting", [])
    config = SchedulerConfig(
        block_size=scenario["block_size"],
        num_blocks=scenario["num_blocks"],
        num_state_slots=len(running) + len(waiting) + 1,
        max_model_len=scenario.get("max_model_len", 4096),
        max_num_seqs=scenario.get("max_num_seqs", 256),
        stop_preempted_request=stop,
        chunked_prefill=False, enable_prefix_caching=False,  # the spec's table
    )
    sched = Scheduler(config, EngineType.NORMAL)
    seqs = []
    for spec in running:
        seq = _sequence(spec["name"], spec["prompt_len"], spec.get("output_len", 0))
        seq.processed = spec["processed"]
        # The import path allocates ceil(processed / block_size) blocks and a state slot;
        # the decode pass then admits the sequences to running in listed order (S27).
        sched.add_prefilled(seq)
        seqs.append(seq)
    for spec in waiting:
        sched.add(_sequence(spec["name"], spec["prompt_len"], spec.get("output_len", 0)))
    # Mid-decode: step 1 is no prefill attempt point (S7), so the step decodes.
    sched.decode_step = 1
    return sched, seqs


def _sequence(name: str, prompt_len: int, output_len: int) -> Sequence:
    seq = Sequence(name, [1 + i % 97 for i in range(prompt_len)])
    seq.token_ids.extend(2 + i % 89 for i in range(output_len))
    return seq


def run_case(scenario: dict, case: dict) -> str:
    sched, seqs = build(scenario, bool(case["stop"]))
    by_name = {s.attempt: s for s in seqs}
    for name, so in case.get("so", {}).items():
        by_name[name].so_status = int(so)
    header = ", ".join([f"stop={bool(case['stop'])}"]
                       + [f"{name}.so_status={so}" for name, so in case.get("so", {}).items()])
    order = sorted(seqs, key=decode_priority)
    history = {s.attempt: len(s) for s in seqs}
    blocks = ", ".join(f"{s.attempt}={len(s.block_table)}" for s in seqs)

    out = sched.schedule()

    victim = out.preempted[0] if out.preempted else None
    lines = [
        header,
        f"  output order: {[(s.attempt, s.output_len) for s in order]}",
        f"  candidate={order[-1].attempt if order else None}; "
        f"victim={victim.attempt if victim else None}; blocks {blocks}",
    ]
    if victim is not None:
        lines.append(f"  {victim.attempt}: {victim.status.name}, processed={victim.processed}, "
                     f"blocks={victim.block_table}, state={victim.state_slot}")
    lines.append(f"  waiting={[s.attempt for s in sched.waiting]}, "
                 f"ignored={[s.attempt for s in out.ignored]}, free={sched.blocks.free_ids}")
    retained = "n/a" if victim is None else len(victim) == history[victim.attempt]
    lines.append(f"  history retained={retained}; "
                 f"scheduled={[row.attempt for row in out.scheduled]}")
    return "\n".join(lines) + "\n"


def run(scenario: dict) -> str:
    return "\n".join(run_case(scenario, case) for case in scenario["cases"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", type=Path, default=None,
                    help="JSON scenario file (default: the chapter's)")
    ap.add_argument("--out", type=Path, default=RESULTS_FILE,
                    help=f"where to save the text (default {RESULTS_FILE})")
    args = ap.parse_args(argv)
    scenario = CHAPTER_SCENARIO
    if args.scenario is not None:
        try:
            scenario = json.loads(args.scenario.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--scenario: {e}")
    try:
        text = run(scenario)
    except (KeyError, ValueError, RuntimeError) as e:
        ap.error(f"bad scenario: {e!r}")
    sys.stdout.write(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"Saved output to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
