"""Compile a C source into a shared library, once, into pdserve's cache.

The one helper the C kernels (``kernels/cbuild.py``: one build per vector ISA) and the
router's loopback-bind shim (``router/embedded_ray.py``) share. It imports nothing of
pdserve, torch or Ray, so any layer may use it.

A library lands in ``$XDG_CACHE_HOME/pdserve`` (or ``~/.cache/pdserve``) under a name
that hashes its source, its headers, the compiler and the flags; a finished build is
renamed into place, so processes starting together never load a half-written file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "pdserve"


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_shared(compiler: str, source: Path, flags: list[str], libs: tuple[str, ...] = (),
                 headers: tuple[Path, ...] = ()) -> Path:
    """``source`` compiled into ``cache_dir()`` under a name hashing it, ``headers``,
    the compiler and flags (built once; renamed into place whole, so processes starting
    together never load a half-written file). Raises OSError / SubprocessError."""
    digest = hashlib.sha256(source.read_bytes())
    for header in headers:
        digest.update(header.read_bytes())
    digest.update(" ".join([compiler, *flags, *libs]).encode())
    target = cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", tmp, *libs], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
