"""In-function imports that give no reason (issue 43: a late import is kept only for an
optional heavy dependency, and says why in one line).

    python scripts/late_imports.py [FOLDER|FILE ...]   # prints each one; exit 1 if any

Without arguments it looks at every folder of the package (``ALL``);
tests/test_late_imports.py holds the folders already audited, which must have none.

A late import is explained by a ``# lazy: <reason>`` comment ending its line, or on the
line just above it; one such comment above the first of several imports in a row (one
after the other in the same block) explains them all. Imports under
``if TYPE_CHECKING:`` are not late imports.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAZY = re.compile(r"# lazy: \S")
ALL = ("bench", "decode_worker", "engine", "kernels", "kv_transfer", "labs", "planner",
       "prefill_worker", "rank", "router", "scheduler", "scripts", "simulator",
       "pdserve")  # pdserve/: its own files (cli.py, ...); its links are not followed


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``if typing.TYPE_CHECKING:``)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Finder:
    """The late imports of one module that no ``# lazy:`` comment explains."""

    def __init__(self, source: str):
        self.lines = source.splitlines()
        self.found: list[ast.stmt] = []

    def _line(self, number: int) -> str:
        return self.lines[number - 1] if 0 < number <= len(self.lines) else ""

    def _own(self, node: ast.stmt) -> bool:
        """A ``# lazy:`` comment on one of the import's own lines."""
        end = node.end_lineno or node.lineno
        return any(LAZY.search(self._line(n)) for n in range(node.lineno, end + 1))

    def _above(self, node: ast.stmt) -> bool:
        """A ``# lazy:`` comment alone on the line just above the import."""
        line = self._line(node.lineno - 1).strip()
        return line.startswith("#") and bool(LAZY.search(line))

    def block(self, body: list[ast.stmt], in_def: bool) -> None:
        shared = False  # a comment above an earlier import of this run explains this one
        for stmt in body:
            if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                shared = False
                self.visit(stmt, in_def)
                continue
            above = self._above(stmt)
            shared = shared or above
            if in_def and not (self._own(stmt) or shared):
                self.found.append(stmt)

    def visit(self, node: ast.AST, in_def: bool) -> None:
        in_def = in_def or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for name, value in ast.iter_fields(node):
            if name == "body" and _type_checking(node):
                continue
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.block(value, in_def)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item, in_def)
            elif isinstance(value, ast.AST):
                self.visit(value, in_def)


def unexplained(source: str) -> list[ast.stmt]:
    """The in-function imports of ``source`` with no ``# lazy:`` reason."""
    finder = _Finder(source)
    finder.visit(ast.parse(source), False)
    return sorted(finder.found, key=lambda n: n.lineno)


def _files(root: Path, entry: str) -> Iterator[Path]:
    """The .py files of a folder (its real ones: a link is not followed) or a file."""
    path = root / entry
    if path.is_file():
        yield path
        return
    if not path.is_dir():
        raise FileNotFoundError(f"no folder or file {entry!r} in {root}")
    for folder, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            full = Path(folder) / name
            if name.endswith(".py") and not full.is_symlink():
                yield full


def unexplained_late_imports(root: Path = ROOT, folders: tuple[str, ...] = ()) -> list[str]:
    """``path:line: import ...`` for each in-function import with no ``# lazy:`` reason
    in ``folders`` (folders or files, relative to ``root``)."""
    out = []
    for entry in folders:
        for path in _files(root, entry):
            source = path.read_text()
            for node in unexplained(source):
                text = source.splitlines()[node.lineno - 1].strip()
                out.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    return out


def main(argv: list[str]) -> int:
    found = unexplained_late_imports(ROOT, tuple(argv) or ALL)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
