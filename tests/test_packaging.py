"""Every package folder is listed in pyproject.toml, so a wheel (not only the editable
install the tests use) carries it."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    tools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tools["packages"])
    found = set()
    for package, folder in tools["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join((package, *parts)))
    assert found - listed == set(), "package folders missing from [tool.setuptools] packages"
    assert listed - found == set(), "listed packages with no folder"
