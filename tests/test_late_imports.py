"""An in-function import gives its reason (``# lazy: ...``) in the folders audited so far;
the checker (scripts/late_imports.py) finds one that does not."""

from __future__ import annotations

import pytest

# Folders (and files) whose late imports were audited: each one left inside a function
# says why. The whole package: every folder of the checker's ALL, pdserve's own files.
AUDITED = ("bench", "simulator", "scripts", "labs", "planner", "kernels", "kv_transfer",
           "engine", "scheduler", "rank", "router", "prefill_worker", "decode_worker",
           "pdserve/cli.py", "pdserve/__init__.py", "pdserve/native.py")


@pytest.fixture(scope="module")
def checker(repo_module):
    return repo_module("scripts/late_imports.py")


def test_every_late_import_in_the_audited_folders_gives_its_reason(checker):
    assert checker.unexplained_late_imports(folders=AUDITED) == []


def test_the_audit_covers_the_whole_package(checker):
    folders = {entry.split("/")[0] for entry in AUDITED}
    assert folders == set(checker.ALL)  # a new folder must be audited (and listed) too


def test_the_checker_finds_a_late_import_without_a_reason(checker, tmp_path):
    folder = tmp_path / "engine"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.py").write_text(
        "import os\n"
        "from typing import TYPE_CHECKING\n\n\n"
        "def f():\n"
        "    if TYPE_CHECKING:  # for annotations only: not a late import\n"
        "        from pdserve.engine.sub import b\n"
        "    import json\n\n"
        "    return json, os\n\n\n"
        "class C:\n"
        "    def g(self):\n"
        "        if self:\n"
        "            from pdserve.engine.sub.b import h  # a comment, no reason\n"
        "            return h\n")
    (folder / "sub" / "b.py").write_text(
        "def h():\n"
        "    import torch  # lazy: torch, only when h runs\n"
        "    # lazy: ray and numpy, only when h runs\n"
        "    import ray\n"
        "    from numpy import (\n"
        "        zeros,\n"
        "    )\n\n"
        "    x = zeros\n"
        "    import grpc\n"
        "    return torch, ray, x, grpc\n\n\n"
        "def k():\n"
        "    # lazy:\n"
        "    import yaml\n"
        "    return yaml\n")
    assert checker.unexplained_late_imports(tmp_path, ("engine",)) == [
        "engine/a.py:8: import json",
        "engine/a.py:16: from pdserve.engine.sub.b import h  # a comment, no reason",
        "engine/sub/b.py:10: import grpc",  # the shared reason ends with the run
        "engine/sub/b.py:16: import yaml",  # a reason left empty
    ]


def test_the_checker_accepts_a_late_import_with_its_reason(checker, tmp_path):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "c.py").write_text(
        "def f():\n"
        "    import torch  # lazy: torch, only for --device runs\n"
        "    return torch\n\n\n"
        "async def g():\n"
        "    # lazy: ray is heavy and only `serve` needs it\n"
        "    import ray\n"
        "    return ray\n")
    (tmp_path / "single.py").write_text("def f():\n    import json\n    return json\n")
    assert checker.unexplained_late_imports(tmp_path, ("tools",)) == []
    assert checker.unexplained_late_imports(tmp_path, ("tools", "single.py")) == [
        "single.py:2: import json"]
    with pytest.raises(FileNotFoundError):  # a misspelt folder is no folder without any
        checker.unexplained_late_imports(tmp_path, ("tool",))
