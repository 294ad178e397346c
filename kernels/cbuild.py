"""Build and load the C kernels beside this file (``skinny_gemm.c``, ``decode_step.c``,
``kv_copy.c``).

A kernel is compiled on first use with the system's C compiler (``cc``, or ``$CC``)
into ``~/.cache/pdserve`` (or ``$XDG_CACHE_HOME/pdserve``), under a name that hashes
its source, the headers here and the flags; a finished build is renamed into place,
so processes starting together never load a half-written file. OpenMP comes from the
runtime torch already loaded, so ``torch.set_num_threads`` applies to the kernels.
Where the CPU lacks AVX-512 (for the kernels that need it), no compiler is found or the
build fails, ``load`` returns None and logs the reason once; callers keep their torch
code. ``load(name, avx512=False)`` builds for any CPU (the compiler's baseline ISA).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC"]
PORTABLE_FLAGS = ["-O3", "-shared", "-fPIC"]


def cpu_has_avx512() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() == "AVX512"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "pdserve"


def _build(compiler: str, source: Path, flags: list[str]) -> Path:
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(HERE.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update(" ".join([compiler, *flags]).encode())
    target = _cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load(name: str, avx512: bool = True) -> ctypes.CDLL | None:
    """The compiled ``<name>.c`` from this folder, or None (reason logged once)."""
    source = HERE / f"{name}.c"
    if avx512 and not cpu_has_avx512():
        log.info("%s off: the CPU has no AVX-512", name)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        log.warning("%s off: no C compiler (cc, gcc or $CC) found", name)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source, FLAGS if avx512 else PORTABLE_FLAGS)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("%s off: building %s failed: %s", name, source.name, detail)
        return None
