"""Triton kernels for the GPU backend (``engine/backends/gpu``): paged attention read
in place (``attention.py``) and the fused layer ops (``layer_ops.py``).

Triton is imported only by these modules, so a CPU installation without it never
loads them. On a CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
set before Triton is imported): the suite tests each one there against the torch
reference it replaces.
"""

from __future__ import annotations

import importlib.util
import os


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Do Triton kernels run on the interpreter (CPU tensors) in this process?"""
    return os.environ.get("TRITON_INTERPRET") == "1"
