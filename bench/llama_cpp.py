"""llama.cpp's `llama-server`, `llama-perplexity` and `llama-bench`, built once from source
into a cache, to measure pdserve beside it on the same GGUF file.

llama.cpp ships no binary wheel and Debian 12 does not package it; the source package of
`llama-cpp-python` (from the package registry) vendors it under `vendor/llama.cpp`. The
build (cmake, Release, native ISA, no curl) takes about 8-15 minutes on 2 cores and is
kept under ``$PDSERVE_CACHE/llama.cpp-<version>-<cpu flags hash>`` (a build for another
CPU is not reused: GGML_NATIVE tunes it to this one). ``isa="avx2"`` builds for AVX2
(with FMA and F16C, no AVX-512) instead, into ``...-avx2``: the same code as a CPU
without AVX-512 runs, for comparing pdserve's AVX2 build on any machine.

    python -m pdserve.bench.llama_cpp            # build (or find) and print the bin folder
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pdserve.engine.model.catalog import model_cache_dir

LLAMA_CPP_PYTHON = "0.3.36"
TARGETS = ("llama-server", "llama-perplexity", "llama-bench")

# Every step is bounded (subprocess.TimeoutExpired past it; the partial build is kept
# and the next run continues it): the fetch from the local index, cmake's configure,
# and the build (8-15 minutes measured on 2 cores; an hour means something is wrong).
FETCH_TIMEOUT_S = 600
CONFIGURE_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 3600


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


ISA_FLAGS = {  # cmake's ISA options per build
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF",
             "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF"],
}


def build_dir(isa: str = "native") -> Path:
    tag = hashlib.sha256(_cpu_flags().encode()).hexdigest()[:10]
    suffix = "" if isa == "native" else f"-{isa}"
    return model_cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON}-{tag}{suffix}"


def binaries(build: Path | None = None) -> dict[str, Path] | None:
    """The built binaries, or None when they are not all there."""
    bin_dir = (build or build_dir()) / "build" / "bin"
    found = {name: bin_dir / name for name in TARGETS}
    return found if all(p.is_file() for p in found.values()) else None


def ensure_built(jobs: int = 2, log=print, isa: str = "native") -> dict[str, Path]:
    """The binaries, built first when the cache has none (minutes: progress is shown);
    ``isa``: a key of ISA_FLAGS."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    build = build_dir(isa)
    found = binaries(build)
    if found:
        return found
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed (apt-get install cmake)")
    build.mkdir(parents=True, exist_ok=True)
    src = build / "src"
    native_src = build_dir() / "src"
    if not (src / "CMakeLists.txt").is_file() and (native_src / "CMakeLists.txt").is_file():
        shutil.copytree(native_src, src, dirs_exist_ok=True)  # the same source, fetched once
    if not (src / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            log(f"fetching llama-cpp-python {LLAMA_CPP_PYTHON} (source) ...")
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--no-binary=:all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                            "-d", tmp], check=True, timeout=FETCH_TIMEOUT_S)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
            if src.exists():
                shutil.rmtree(src)
            shutil.copytree(vendored, src)
    log(f"building llama.cpp into {build} (about 8-15 minutes on 2 cores) ...")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build / "build"),
                    "-DCMAKE_BUILD_TYPE=Release", *ISA_FLAGS[isa], "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"],
                   check=True, stdout=subprocess.DEVNULL, timeout=CONFIGURE_TIMEOUT_S)
    subprocess.run(["cmake", "--build", str(build / "build"), "--target", *TARGETS,
                    f"-j{jobs}"], check=True, timeout=BUILD_TIMEOUT_S)
    found = binaries(build)
    if not found:
        raise RuntimeError(f"the llama.cpp build in {build} left no {', '.join(TARGETS)}")
    return found


if __name__ == "__main__":
    print(ensure_built(isa=sys.argv[1] if len(sys.argv) > 1 else "native")["llama-server"].parent)
