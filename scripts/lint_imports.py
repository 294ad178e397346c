"""Check the import contracts in ``pyproject.toml`` (``[tool.importlinter]``) with
import-linter's own ``lint-imports`` on a tree of links (the tests use it to check a
copy of the package with a wrong-way import added; the repository's own ``pdserve/``
holds committed links to its parts, so a plain ``lint-imports`` works there too).

import-linter finds a package's modules by walking the folder of its ``__init__.py``,
but pdserve's subpackages are top-level folders mapped into it by ``package-dir``
(``scheduler/`` is ``pdserve.scheduler``, ``protos/pdserve/rpc/`` is ``pdserve.rpc``).
So this script lays out the package as Python sees it once installed: a folder
``pdserve/`` of symbolic links (``pdserve/scheduler -> <repo>/scheduler``, ...) built
from ``package-dir``, put first on ``PYTHONPATH``; then it runs ``lint-imports`` (the one
beside this Python) on ``pyproject.toml`` with the arguments it was given, and exits
with its status.

    python scripts/lint_imports.py            # what ``make lint`` runs
    python scripts/lint_imports.py --verbose  # any lint-imports option passes through

The links live under ``build/import-linter/`` (rebuilt on every run, so a new module or
subpackage is always seen) and import-linter's cache under ``build/import-linter-cache/``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
ROOT_PACKAGE = "pdserve"


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """``package-dir`` from ``pyproject.toml``: package name -> its folder."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: (root / folder).resolve() for name, folder in mapping.items()}


def link_tree(dest: Path, root: Path = ROOT) -> Path:
    """Build ``dest/pdserve/`` as links to the sources; returns ``dest`` (for the path)."""
    dirs = package_dirs(root)
    top = dirs.pop(ROOT_PACKAGE)
    if dest.exists():
        shutil.rmtree(dest)
    pkg = dest / ROOT_PACKAGE
    pkg.mkdir(parents=True)
    subpackages = {name.split(".")[1] for name in dirs}
    for entry in top.iterdir():  # pdserve/__init__.py, pdserve/cli.py, ...
        # (pdserve/ also holds committed links to the parts: made afresh below)
        if entry.name != "__pycache__" and entry.name not in subpackages:
            (pkg / entry.name).symlink_to(entry)
    for name, folder in sorted(dirs.items()):
        parts = name.split(".")[1:]
        if len(parts) != 1:
            raise SystemExit(f"{name}: only pdserve.<part> subpackages are mapped here")
        link = pkg / parts[0]
        if link.exists() or link.is_symlink():
            raise SystemExit(f"{name}: {link} already exists in {top}")
        link.symlink_to(folder, target_is_directory=True)
    return dest


def lint_imports_bin() -> str:
    """The ``lint-imports`` installed beside this Python (the venv's)."""
    exe = Path(sys.executable).parent / "lint-imports"
    return str(exe) if exe.exists() else "lint-imports"


def run(args: list[str], tree: Path, config: Path = ROOT / "pyproject.toml",
        capture: bool = False) -> subprocess.CompletedProcess:
    """``lint-imports CONFIG args`` with ``tree`` (a :func:`link_tree`) as the package.

    It runs in ``tree``: lint-imports puts its working directory first on the path, and
    in the repository that would find the folder ``pdserve/`` (``__init__.py`` and
    ``cli.py`` only) before the links."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([lint_imports_bin(), str(config), *args], cwd=tree, env=env,
                          capture_output=capture, text=True, check=False)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    tree = link_tree(ROOT / "build" / "import-linter")
    if not any(a == "--no-cache" or a.startswith("--cache-dir") for a in args):
        args += ["--cache-dir", str(ROOT / "build" / "import-linter-cache")]
    return run(args, tree).returncode

if __name__ == "__main__":
    sys.exit(main())
