"""Build and load the C kernels beside this file (``skinny_gemm.c``, ``decode_step.c``,
``argmax.c``, ``kv_copy.c``) for the CPU's vector ISA.

Each kernel is one source written in ``simd.h``'s width-generic vectors and built for
one of ``ISAS``: ``avx512`` (-mavx512f -mavx512bw -mavx512vl, and -mavx512vnni where the
CPU has VNNI's integer dot product), ``avx2`` (-mavx2 -mfma) or ``generic`` (the
compiler's baseline: SSE2 on x86-64, NEON on aarch64). ``load(name)`` builds for the
best ISA the CPU reports (``host_isa``); ``load(name, isa)`` for another one it can run
(``runnable_isas``: an AVX-512 CPU runs all three, so tests and benchmarks cover every
build on one machine). Tests also check the avx512 source's paths a CPU cannot run or
does not take (AVX-512 itself, VNNI's dot or vpmaddubsw's) in ``EMULATED`` builds,
compiled for AVX2 with ``avx512_emulated.h`` (``tested_isas``; never served).

A kernel is compiled on first use with the system's C compiler (``cc``, or ``$CC``)
into ``~/.cache/pdserve`` (or ``$XDG_CACHE_HOME/pdserve``), under a name that hashes
its source, the headers here and the flags (``pdserve/native.py``, which the router's
loopback shim uses too); a finished build is renamed into place, so processes
starting together never load a half-written file. OpenMP comes from the
runtime torch already loaded, so ``torch.set_num_threads`` applies to the kernels.
Where no compiler is found or the build fails, ``load`` returns None and logs the
reason once; callers keep their torch code.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import subprocess
from pathlib import Path

from pdserve.native import build_shared, find_compiler

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
COMMON_FLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
# Best first. Each ISA: the /proc/cpuinfo flags it needs and the compiler flags for it.
ISAS = ("avx512", "avx2", "generic")
_ISA_CPU_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma", "f16c"),
                  "generic": ()}
_ISA_COMPILER_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"],
                       "avx2": ["-mavx2", "-mfma", "-mf16c"], "generic": []}
# Added where the CPU has them: int8 activations' dot products in one instruction
# (dot_block.h) instead of a multiply-add pair and an add.
_OPTIONAL_COMPILER_FLAGS = {"avx512": (("avx512_vnni", "-mavx512vnni"),)}
# Builds for tests only (never in ISAS, so never served): the avx512 source compiled for
# AVX2 with avx512_emulated.h, which writes its AVX-512 intrinsics in AVX2 with the
# instructions' exact results, so a CPU without AVX-512, or without VNNI, still checks
# those paths of the kernels against their references. Name -> extra flags.
EMULATED = {"avx512-emulated": (), "avx512vnni-emulated": ("-DPDSERVE_EMULATE_VNNI",)}
# -O1 (the last -O given wins): GCC's -O3 takes 82 s on the emulated decode step (its
# RTL CSE over 512-bit vectors split in two), -O1 9 s; -fexpensive-optimizations keeps
# the FMA contraction.
_EMULATED_FLAGS = ["-O1", "-fexpensive-optimizations", "-Wno-psabi",
                   "-include", str(HERE / "avx512_emulated.h")]


@functools.cache
def _cpu_flags() -> frozenset[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def runnable_isas() -> tuple[str, ...]:
    """The builds this CPU can execute, best first (always ends with ``generic``)."""
    return _isas_for(_cpu_flags())


@functools.cache
def _isas_for(flags: frozenset[str]) -> tuple[str, ...]:
    # cached: every kernel call resolves its build (three times a decode step)
    return tuple(isa for isa in ISAS if all(f in flags for f in _ISA_CPU_FLAGS[isa]))


def tested_isas() -> tuple[str, ...]:
    """What tests check on this CPU: the builds it runs, then each emulated AVX-512 one
    whose path its own avx512 build does not take (where it runs avx2, which they are
    compiled for): both without AVX-512, the other way of the integer dot with it."""
    runs = runnable_isas()
    if "avx2" not in runs:
        return runs
    if "avx512" not in runs:
        return runs + tuple(EMULATED)
    taken = "avx512vnni-emulated" if "avx512_vnni" in _cpu_flags() else "avx512-emulated"
    return runs + tuple(isa for isa in EMULATED if isa != taken)


def host_isa() -> str:
    """The build ``load`` picks by default: the widest vectors the CPU reports."""
    return runnable_isas()[0]


def cpu_has_avx512() -> bool:
    return "avx512" in runnable_isas()


def resolve_isa(isa: str | None) -> str:
    """``isa``, or the host's for None / "auto"; ValueError naming what this CPU can
    run when it is not one of them."""
    if isa in (None, "auto"):
        return host_isa()
    if isa in EMULATED and "avx2" in runnable_isas():
        return isa
    if isa not in ISAS:
        raise ValueError(f"kernel_isa must be one of auto, {', '.join(ISAS)}; got {isa!r}")
    if isa not in runnable_isas():
        raise ValueError(f"kernel_isa {isa!r} cannot run on this CPU (it runs "
                         f"{', '.join(runnable_isas())})")
    return isa


@functools.cache
def load(name: str, isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled ``<name>.c`` from this folder for ``isa`` (default: ``host_isa``),
    or None (reason logged once)."""
    # lazy: torch first, its OpenMP runtime serves the kernels; the CLI imports cbuild torch-free
    import torch  # noqa: F401

    isa = resolve_isa(isa)
    source = HERE / f"{name}.c"
    compiler = find_compiler()
    if not compiler:
        log.warning("%s off: no C compiler (cc, gcc or $CC) found", name)
        return None
    try:
        flags = _compiler_flags(isa)
        lib = ctypes.CDLL(str(build_shared(compiler, source, flags,
                                           headers=tuple(sorted(HERE.glob("*.h"))))))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("%s off: building %s for %s failed: %s", name, source.name, isa, detail)
        return None
    if hasattr(lib, "simd_isa"):  # kernels written in simd.h say what they were built for
        lib.simd_isa.restype = ctypes.c_char_p
        built = lib.simd_isa().decode()
        if built != ("avx512" if isa in EMULATED else isa):
            log.warning("%s off: asked for %s, the compiler built %s", name, isa, built)
            return None
    return lib


def _compiler_flags(isa: str) -> list[str]:
    if isa in EMULATED:
        return COMMON_FLAGS + _ISA_COMPILER_FLAGS["avx2"] + _EMULATED_FLAGS + list(EMULATED[isa])
    return COMMON_FLAGS + _ISA_COMPILER_FLAGS[isa] + [
        flag for cpu_flag, flag in _OPTIONAL_COMPILER_FLAGS.get(isa, ())
        if cpu_flag in _cpu_flags()]
