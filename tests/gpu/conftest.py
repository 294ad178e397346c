"""The Triton kernels run on CPU tensors under Triton's interpreter here; on a machine
with CUDA they run compiled, on the GPU (``device``)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # read when a kernel is decorated, so before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    """On a machine with CUDA these tests run on the GPU: mark them ``gpu`` so that a
    GPU run (``pytest -m gpu``) takes them too."""
    if torch.cuda.is_available():
        here = os.path.dirname(__file__)
        for item in items:
            if str(item.fspath).startswith(here):
                item.add_marker(pytest.mark.gpu)
