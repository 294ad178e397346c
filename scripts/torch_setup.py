"""Install the torch `make setup` wants: the pinned CPU build on a machine without an
NVIDIA driver (unchanged), a CUDA build where there is one, and nothing where a CUDA
build is installed already (a GPU user's own).

    python scripts/torch_setup.py            # what make setup runs, in the venv
    python scripts/torch_setup.py --dry-run  # print the pip command only

PyPI's Linux wheel of the pinned release is its CUDA build; a local CPU build (pip's
find-links on this project's machines: /opt/wheels) would win the same pin, so on a
GPU machine pip runs isolated from local configuration.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

TORCH = "torch==2.13.0"


def nvidia_driver(proc: Path = Path("/proc/driver/nvidia/version")) -> bool:
    """An NVIDIA kernel driver is loaded (or its tool is on PATH)."""
    return proc.exists() or shutil.which("nvidia-smi") is not None


def installed_torch() -> tuple[str, str | None] | None:
    """(version, CUDA version or None) of the torch this interpreter imports, if any."""
    try:
        # lazy: torch may be missing: this script installs it
        import torch
    except ImportError:
        return None
    return torch.__version__, torch.version.cuda


def pip_args(driver: bool, installed: tuple[str, str | None] | None) -> list[str] | None:
    """pip's arguments for torch, or None to keep what is installed."""
    if installed is not None and installed[1]:
        return None  # a CUDA build is here already: the user's choice
    if not driver:
        return ["install", "--quiet", TORCH]  # the CPU build on these machines' disk
    # a CPU build installed satisfies the pin too: replace it
    force = ["--force-reinstall"] if installed is not None else []
    return ["--isolated", "install", "--quiet", *force, TORCH]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    driver, installed = nvidia_driver(), installed_torch()
    pip = pip_args(driver, installed)
    if pip is None:
        print(f"torch {installed[0]} (CUDA {installed[1]}) is installed: kept")
        return 0
    cmd = [sys.executable, "-m", "pip", *pip]
    print(("NVIDIA driver found: a CUDA build of torch" if driver else "no NVIDIA driver: "
           "torch's CPU build") + f": {' '.join(cmd[1:])}", flush=True)
    return 0 if args.dry_run else subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
