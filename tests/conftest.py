"""Shared test setup: interpreted Triton on CPU-only machines, GPU-test skipping, fixtures."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Must run before anything imports triton (torch does not): triton picks the interpreter when
# it loads, and without a GPU the interpreter is the only way the kernels run at all.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # One intra-op thread: the suite's workers (one per core) run beside each other and beside
    # the sandbox's judges and runners, and spinning idle threads slow everyone on a small host.
    torch.set_num_threads(1)
    # The interpreter without its re-patching of triton.language at each helper call
    # (test_attention.py: 114 -> 84 s on one core), as the sandbox's runners run it:
    # sandbox/interpreter_calls.py says why that changes nothing else.
    from sandbox import interpreter_calls

    interpreter_calls.install()

if TYPE_CHECKING:
    from kernels.registry import KernelLibrary


# The files that take longest on a 2-core CPU machine (about 20 s or more each, in `make test`),
# longest first. With `--dist loadfile` pytest-xdist gives each worker a file at a time, in the
# order of the collection: these go first, and the many short files last, where they even out
# the two workers' ends (in xdist's own order, most tests first, a minute-long file of three tests
# came last and ran alone). A file not named here goes after them, by its number of tests.
LONGEST_FIRST = [
    "sandbox/test_adversarial.py",
    "kernels/test_embedding_bags_update.py",
    "kernels/test_attention.py",
    "sandbox/test_adversarial_updates.py",
    "sandbox/test_judge.py",
    "agent/test_campaign.py",
    "model/test_sharding.py",
    "kernels/test_embedding_bags.py",
    "sandbox/test_local_backend.py",
    "agent/test_llm_campaign.py",
    "agent/test_llm_kills.py",
    "model/test_model_training.py",
    "sandbox/test_ray_backend.py",
    "model/test_gem.py",
    "kernels/test_jagged_transforms.py",
    "sandbox/test_judge_server.py",
    "ops/test_plugin_op.py",
    "search_space/test_attention_templates.py",
    "kernels/test_attention_ops.py",
    "agent/test_llm_units.py",
    "sandbox/test_adversarial_unscreened.py",
    "search_space/test_attention_problems.py",
    "agent/test_review.py",
    "agent/test_model_campaign.py",
]


def pytest_configure(config: pytest.Config) -> None:
    # xdist reorders the files of --dist loadfile by their number of tests unless told to keep
    # the collection's order, which pytest_collection_modifyitems sets.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _longest_first(items: list[pytest.Item]) -> None:
    """`items` reordered file by file, LONGEST_FIRST's files first (each file's own order kept)."""
    tests = Path(__file__).parent
    rank = {tests / name: i for i, name in enumerate(LONGEST_FIRST)}
    count = Counter(item.path for item in items)
    items.sort(key=lambda item: (rank.get(item.path, len(rank)), -count[item.path]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_first(items)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    skip_two = pytest.mark.skip(reason=f"needs two CUDA GPUs; this host has {gpus}")
    for item in items:
        if gpus == 0 and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
        if gpus < 2 and item.get_closest_marker("two_gpus") is not None:
            item.add_marker(skip_two)


@pytest.fixture
def device() -> torch.device:
    """The GPU when there is one, else the CPU (kernels then run in the Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def empty_library(tmp_path: Path) -> Iterator[KernelLibrary]:
    """Points the dispatcher at a fresh, empty kernel library; restores the original after."""
    import kernels.ops  # noqa: F401  (registers the ops with the dispatcher)
    from kernels import DISPATCHER

    original = DISPATCHER.library
    yield DISPATCHER.use_library(tmp_path / "library")
    # The same object back, with the modules it already imported.
    DISPATCHER._library = original
