"""Lab 11 (chapter section 5.1): the chapter's printed runs, other scenarios, the plot."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "labs" / "11_chunks.py"
# Section 5.1's printed outputs, copied verbatim from the book chapter into the repository
# (see the notes at the top of the file): the tests read nothing outside the repository.
CHAPTER_OUTPUTS = REPO / "tests" / "data" / "chapter_5_1_outputs.txt"

lab = importlib.import_module("pdserve.labs.11_chunks")


def chapter_runs() -> list[str]:
    """Section 5.1's OUTPUT blocks, as the chapter prints them (its captions dropped)."""
    text = CHAPTER_OUTPUTS.read_text(encoding="utf-8")
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    blocks = []
    for chunk in ("\n" + body).split("\nOUTPUT\n")[1:]:
        lines = []
        for line in chunk.splitlines():
            # A block ends at a blank line or at the book's "Saved output · <file>" caption.
            if not line.strip() or line.startswith("Saved output"):
                break
            lines.append(line)
        blocks.append("\n".join(lines))
    assert len(blocks) == 3, f"expected three OUTPUT blocks in section 5.1, found {len(blocks)}"
    return blocks


def run_lab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAB), *args], cwd=cwd, capture_output=True,
                          encoding="utf-8", timeout=60, check=True)


def test_no_args_prints_the_chapter_runs_and_saves_them(tmp_path):
    proc = run_lab(cwd=tmp_path)
    expected = chapter_runs()
    got = [b.strip("\n") for b in proc.stdout.split("\n\n")]
    assert got == expected
    saved = tmp_path / "results" / "11_chunks.txt"
    assert saved.read_text() == proc.stdout
    assert proc.stderr.strip() == "Saved output · results/11_chunks.txt"  # the book's caption


def test_runs_as_data_match_the_chapter_numbers():
    runs = lab.three_runs(lab.parse_requests(lab.DEFAULT_REQUESTS), budget=4, overhead=1)
    assert [r.delays for r in runs] == [
        {"A": 13, "B": 13, "C": 16},
        {"A": 15, "B": 15, "C": 18},
        {"A": 21, "B": 5, "C": 8},
    ]
    assert [(r.work, len(r.steps), r.finish) for r in runs] == [(16, 3, 19), (16, 5, 21), (16, 5, 21)]
    assert "\n".join(lab.format_run(runs[2])) == chapter_runs()[2]


def test_overhead_zero_hand_derived():
    reqs = lab.parse_requests("A:0:12,B:3:2,C:3:2")
    whole, front, back = lab.three_runs(reqs, budget=4, overhead=0)
    assert [(s.start, s.end, s.name, s.q) for s in whole.steps] == [
        (0, 12, "A", 12), (12, 14, "B", 2), (14, 16, "C", 2)]
    assert whole.delays == {"A": 12, "B": 11, "C": 13}
    assert [(s.start, s.end, s.name) for s in front.steps] == [
        (0, 4, "A"), (4, 8, "A"), (8, 12, "A"), (12, 14, "B"), (14, 16, "C")]
    assert front.delays == {"A": 12, "B": 11, "C": 13}
    assert [(s.start, s.end, s.name, s.waiting) for s in back.steps] == [
        (0, 4, "A", ("B", "C", "A")), (4, 6, "B", ("C", "A")), (6, 8, "C", ("A",)),
        (8, 12, "A", ("A",)), (12, 16, "A", ())]
    assert back.delays == {"A": 16, "B": 3, "C": 5}
    assert (back.work, len(back.steps), back.finish) == (16, 5, 16)


def test_idle_scheduler_jumps_to_next_arrival():
    reqs = lab.parse_requests("A:0:2,B:10:3")
    whole, front, back = lab.three_runs(reqs, budget=2, overhead=1)
    assert whole.title == "Whole prompts, FIFO (budget 3)"
    assert [(s.start, s.end, s.name, s.q) for s in whole.steps] == [(0, 3, "A", 2), (10, 14, "B", 3)]
    assert whole.delays == {"A": 3, "B": 4}
    for run in (front, back):
        assert [(s.start, s.end, s.name, s.q) for s in run.steps] == [
            (0, 3, "A", 2), (10, 13, "B", 2), (13, 15, "B", 1)]
        assert run.delays == {"A": 3, "B": 5}
        assert (run.work, len(run.steps), run.finish) == (5, 3, 15)
    # The first arrival after time 0 is also an idle jump.
    steps, delays = lab.simulate(lab.parse_requests("A:5:2"), budget=4, overhead=1)
    assert [(s.start, s.end) for s in steps] == [(5, 8)] and delays == {"A": 3}


def test_arrival_at_step_end_joins_before_the_put_back():
    steps, delays = lab.simulate(lab.parse_requests("A:0:4,B:3:1"), budget=2, overhead=1,
                                 rotate=True)
    assert [(s.start, s.end, s.name, s.waiting) for s in steps] == [
        (0, 3, "A", ("B", "A")), (3, 5, "B", ("A",)), (5, 8, "A", ())]
    assert delays == {"A": 8, "B": 2}
    steps, _ = lab.simulate(lab.parse_requests("A:0:4,B:3:1"), budget=2, overhead=1)
    assert steps[0].waiting == ("A", "B")


def test_cli_flags_and_plot(tmp_path, capsys):
    png = tmp_path / "plots" / "runs.png"
    out = tmp_path / "res" / "lab11.txt"
    assert lab.main(["--requests", "A:0:2,B:10:3", "--budget", "2", "--overhead", "1",
                     "--plot", str(png), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[:3] == [
        "Whole prompts, FIFO (budget 3)",
        "   0-> 3: A q= 2 waiting=[]",
        "  10->14: B q= 3 waiting=[]",
    ]
    assert "  first-token delays: A=3, B=5" in printed
    assert out.read_text() == printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.parametrize("bad", ["A:0", "A:x:2", "A:0:0", ":0:2", "A:-1:2"])
def test_bad_requests_are_refused(bad):
    with pytest.raises(ValueError):
        lab.parse_requests(bad)
