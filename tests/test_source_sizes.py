"""No source file of the product, its benches or scripts over 500 lines (generated
protobuf code and tests aside): a file that grows past it holds more than one idea."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500
SKIPPED = {".venv", "build", "tests", "pdserve", ".git", "results"}  # pdserve/: links


def source_files() -> list[Path]:
    return [p for p in ROOT.rglob("*.py")
            if not (set(p.relative_to(ROOT).parts[:-1]) & SKIPPED or "_pb2" in p.name)]


def test_no_source_file_is_over_500_lines():
    files = source_files()
    assert len(files) > 100  # the walk found the tree
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these into modules with one idea each: {long}"
