"""Import cycles inside each folder of the package, in-function imports included (a late
import hides a loop; it does not remove it).

    python scripts/import_cycles.py      # prints each cycle's modules; exit 1 if any

import-linter's contracts keep the folders in layers (no loop between folders); this
looks inside one folder, where they do not.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("bench", "decode_worker", "engine", "kernels", "kv_transfer", "labs", "planner",
           "prefill_worker", "rank", "router", "scheduler", "simulator")


def modules(folder: Path) -> dict[str, Path]:
    """Dotted name inside the folder (``grpc.transport``; ``""`` for its __init__) -> file."""
    out = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(package: str, name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``package`` (``pdserve.<folder>``) that module ``name`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            base = node.module
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in targets:
            if target == package or not target.startswith(package + "."):
                continue
            inner = target[len(package) + 1:]
            if inner in known and inner != name:
                found.add(inner)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a loop (each
    sorted; a folder holds few enough modules to ask every pair)."""
    reach = {v: reachable(graph, v) for v in graph}
    groups = {tuple(sorted({v} | {w for w in reach[v] if v in reach[w]}))
              for v in graph if v in reach[v]}
    return sorted(list(g) for g in groups)


def folder_cycles(root: Path = ROOT, folders: tuple[str, ...] = FOLDERS
                  ) -> dict[str, list[list[str]]]:
    """Folder -> its import cycles (each a sorted list of module names)."""
    out = {}
    for folder in folders:
        known = modules(root / folder)
        package = f"pdserve.{folder}"
        graph = {name: imports(package, name, path, known) for name, path in known.items()}
        found = cycles(graph)
        if found:
            out[folder] = found
    return out


def main() -> int:
    found = folder_cycles()
    for folder, loops in found.items():
        for loop in loops:
            print(f"{folder}: {' <-> '.join(loop)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
