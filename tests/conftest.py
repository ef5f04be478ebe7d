"""Shared test setup: interpreted Triton on CPU-only machines, GPU-test skipping, `device`."""

import os

import torch

# Must run before anything imports triton: the interpreter is chosen when triton loads, and
# without a GPU it is the only way the kernels run at all.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    """The GPU when there is one, else the CPU (kernels then run in the Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def empty_library(tmp_path):
    """Points the dispatcher at a fresh, empty kernel library; restores the original after."""
    import kernels.ops  # noqa: F401  (registers the ops with the dispatcher)
    from kernels import DISPATCHER

    original = DISPATCHER.library
    yield DISPATCHER.use_library(tmp_path / "library")
    # The same object back, with the modules it already imported.
    DISPATCHER._library = original
