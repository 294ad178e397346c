"""Attention backends behind one seam (``base.py``): ``cpu/`` and ``gpu/``."""

from __future__ import annotations

import logging

from pdserve.engine.backends.cpu.backend import CpuBackend
from pdserve.kernels.gpu import triton_installed

BACKENDS = ("auto", "cpu", "gpu")
log = logging.getLogger(__name__)


def select_backend(name: str, model, cache, kv_budget_bytes: int, adaptive_threads: bool,
                   max_num_seqs: int):
    """The backend ``name`` for a model and its cache, set on the model and started: ``auto`` is ``gpu`` on a CUDA
    device where Triton is installed, else ``cpu`` (whose torch path also runs on a GPU,
    slowly)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    on_cuda = cache.device.type == "cuda"
    if name == "auto":
        name = "gpu" if on_cuda and triton_installed() else "cpu"
        if on_cuda and name == "cpu":
            log.warning("Triton is not installed: the GPU runs the torch reference path "
                        "(pip install triton for paged attention and CUDA graphs)")
    if name == "gpu":
        if not triton_installed():
            raise ValueError("backend 'gpu' needs Triton (pip install triton)")
        # lazy: the GPU backend imports triton, optional (the gpu extra): only backend gpu
        from pdserve.engine.backends.gpu.backend import GpuBackend

        backend = GpuBackend(model, cache, max_rows=max_num_seqs)
    else:
        backend = CpuBackend(model, cache, kv_budget_bytes, adaptive_threads and not on_cuda)
    model.use_backend(backend)
    backend.start()
    return backend
