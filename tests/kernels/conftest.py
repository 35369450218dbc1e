"""Run the Triton kernel tests under the interpreter on machines without CUDA.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` decorator runs, i.e. before ``kernels.triton`` is
imported; pytest imports this file before the test modules beside it. Only Triton reads the variable, and
the engine's CPU path never imports Triton, so setting it for the rest of the session is harmless. On a CUDA
machine nothing is set and the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Where Triton kernels run: the interpreter works on CPU tensors, compiled kernels on CUDA tensors.
TRITON_DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


@pytest.fixture
def triton_device() -> torch.device:
    return TRITON_DEVICE
