"""The import contracts in pyproject.toml (``[tool.importlinter]``) hold, and a
wrong-way import breaks them.

Both run import-linter's own ``lint-imports`` through ``scripts/lint_imports.py`` (the
package laid out as links, since ``package-dir`` maps top-level folders into pdserve).
The second test copies one part of the package into a temporary tree, adds a module
that imports the wrong way, and checks the real contracts catch it by name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def lint(repo_module):
    return repo_module("scripts/lint_imports.py")


def _run(lint, tree: Path) -> tuple[int, str]:
    done = lint.run(["--no-cache", "--no-logo"], tree, capture=True)
    return done.returncode, done.stdout + done.stderr


def test_contracts_hold(lint, tmp_path):
    rc, out = _run(lint, lint.link_tree(tmp_path / "tree"))
    assert rc == 0, out
    assert "0 broken" in out, out
    for name in ("layers", "no product module imports pdserve.bench", "import no torch",
                 "engine's areas", "the model"):
        assert name in out, out


@pytest.mark.parametrize("part, source, contract", [
    # the lowest product layer reaching up to the router
    ("scheduler", "import pdserve.router.routing\n", "layers"),
    # a lower layer reaching up one step, the way the rank <-> kv_transfer cycle went
    ("kv_transfer", "from pdserve.rank import messages\n", "layers"),
    # the planner reaching into the router (the router hosts the planner, not the reverse)
    ("planner", "from pdserve.router.pools import Pool\n", "layers"),
    # product code using a benchmark's helper
    ("router", "from pdserve.bench.serve_metrics import latency_stats\n",
     "no product module imports pdserve.bench"),
    # the router's process loading torch
    ("router", "import torch\n", "import no torch"),
    # one area of the engine reaching into another (KV hand-off code using speculation)
    ("engine/kv", "from pdserve.engine.speculative import decoding\n", "engine's areas"),
    # the model reaching up into the step loop
    ("engine/model", "from pdserve.engine import model_runner\n", "the model"),
])
def test_a_wrong_way_import_is_caught(lint, tmp_path, part, source, contract):
    tree = lint.link_tree(tmp_path / "tree")
    top, _, sub = part.partition("/")
    link = tree / "pdserve" / top
    real = link.resolve()
    link.unlink()
    shutil.copytree(real, link, ignore=shutil.ignore_patterns("__pycache__"))
    wrong = link / sub / "_wrong_way.py"
    wrong.write_text(f'"""Imports the wrong way (a test)."""\n\n{source}')

    rc, out = _run(lint, tree)
    assert rc == 1, out
    broken = [line for line in out.splitlines() if line.endswith(" BROKEN")]
    assert any(contract in line for line in broken), out
    assert f"pdserve.{part.replace('/', '.')}._wrong_way" in out, out

    # The same copy without that module keeps every contract.
    wrong.unlink()
    rc, out = _run(lint, tree)
    assert rc == 0, out
