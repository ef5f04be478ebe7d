"""Model tests run on a GPU when there is one, else on the CPU through interpreted Triton."""

import os

import pytest
import torch

# Triton picks interpreted or compiled kernels when `@triton.jit` runs, that is when the kernel
# modules are imported: the variable must be set before anything imports `kernels`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
