"""Lab 12 (chapter section 5.3): the printed preemption cases, and a hand-derived scenario."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "labs" / "12_preempt.py"
# Section 5.3's printed output, copied verbatim from the book chapter into the repository
# (see the notes at the top of the file): the tests read nothing outside the repository.
CHAPTER_OUTPUTS = REPO / "tests" / "data" / "chapter_5_3_outputs.txt"


def chapter_output() -> str:
    """Section 5.3's OUTPUT block as the chapter prints it, without the book's
    "Saved output · <file>" caption."""
    text = CHAPTER_OUTPUTS.read_text(encoding="utf-8")
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body.count("OUTPUT") == 1, "expected one OUTPUT block for section 5.3"
    lines = []
    for line in body[body.index("OUTPUT") + 1:]:
        if line.startswith("Saved output"):
            break
        lines.append(line)
    assert len(lines) == 20, f"expected three cases of six lines, got {len(lines)} lines"
    return "\n".join(lines) + "\n"


def run_lab(tmp_path: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, str(LAB), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=True)
    saved = (tmp_path / "results" / "12_preempt.txt").read_text()
    assert saved == done.stdout
    return done.stdout


def test_lab12_reproduces_the_chapter(tmp_path):
    assert run_lab(tmp_path) == chapter_output()


def test_lab12_chapter_scenario_file_matches_default(tmp_path):
    scenario = {
        "block_size": 4, "num_blocks": 20,
        "running": [{"name": "A", "prompt_len": 12, "output_len": 8, "processed": 19},
                    {"name": "B", "prompt_len": 43, "output_len": 2, "processed": 44},
                    {"name": "C", "prompt_len": 9, "output_len": 4, "processed": 12}],
        "waiting": [{"name": "D", "prompt_len": 6}],
        "cases": [{"stop": False, "so": {"A": 0}}, {"stop": True, "so": {"A": 0}},
                  {"stop": False, "so": {"A": 1}}],
    }
    path = tmp_path / "chapter.json"
    path.write_text(json.dumps(scenario))
    assert run_lab(tmp_path, "--scenario", str(path)) == chapter_output()


# Derived by hand. Block size 2, 7 usable blocks, all owned: X [1, 2], Y [3, 4, 5],
# Z [6, 7]. Output order Y(3), X(2), Z(2) (X and Z tie: arrival order). The first
# candidate is Z; no block is free, so the victim is Y, whose table returns 5, 4, 3.
# Z (history 4, 2 blocks) needs none; X (history 5) needs a third block and takes 5,
# leaving [4, 3]. The batch is ordered by history: X (5), Z (4).
HAND_SCENARIO = {
    "block_size": 2, "num_blocks": 8,
    "running": [{"name": "X", "prompt_len": 3, "output_len": 2, "processed": 4},
                {"name": "Y", "prompt_len": 4, "output_len": 3, "processed": 6},
                {"name": "Z", "prompt_len": 2, "output_len": 2, "processed": 3}],
    "waiting": [{"name": "W", "prompt_len": 2}],
    "cases": [{"stop": False, "so": {"Y": 0}}, {"stop": False, "so": {"Y": -1}}],
}
HAND_EXPECTED = """\
stop=False, Y.so_status=0
  output order: [('Y', 3), ('X', 2), ('Z', 2)]
  candidate=Z; victim=Y; blocks X=2, Y=3, Z=2
  Y: WAITING, processed=0, blocks=[], state=-1
  waiting=['Y', 'W'], ignored=[], free=[4, 3]
  history retained=True; scheduled=['X', 'Z']

stop=False, Y.so_status=-1
  output order: [('Y', 3), ('X', 2), ('Z', 2)]
  candidate=Z; victim=Y; blocks X=2, Y=3, Z=2
  Y: FINISHED_PREEMPTED, processed=6, blocks=[], state=-1
  waiting=['W'], ignored=['Y'], free=[4, 3]
  history retained=True; scheduled=['X', 'Z']
"""


def test_lab12_hand_derived_scenario(tmp_path):
    path = tmp_path / "hand.json"
    path.write_text(json.dumps(HAND_SCENARIO))
    assert run_lab(tmp_path, "--scenario", str(path)) == HAND_EXPECTED


def test_lab12_rejects_a_bad_scenario(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"block_size": 4}')
    done = subprocess.run([sys.executable, str(LAB), "--scenario", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "bad scenario" in done.stderr
