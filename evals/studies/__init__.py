"""One-off studies: sweeps, comparisons and probes behind figures in BENCHMARKS.md. Product
benchmarks (bench ops, bench sandbox) are evals/bench_*.py; nothing here is imported by them."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch


def default_at_each_shape(name: str) -> Iterator[tuple]:
    """(shape, the op's default kernel, the warm-up's input sets of `bench ops`) at each of the
    op's timing shapes on this device; each shape's sets freed before the next are drawn."""
    from evals.bench_common import BenchRun
    from kernels import ops
    from kernels.registry import DISPATCHER
    from search_space import get_problem

    problem, run = get_problem(name), BenchRun.here()
    ops.op(name)  # defines the op and its default kernel
    fn = DISPATCHER.default(name)
    for shape in problem.timing_shapes:
        sets = run.input_sets(problem, shape)
        yield shape, fn, sets
        del sets
        torch.cuda.empty_cache()


def each_op(study: Callable[[str], None], ops: tuple[str, ...]) -> None:
    """`study` of each op named on the command line, or of `ops`."""
    for name in sys.argv[1:] or ops:
        study(name)


def module_from_file(path: Path | str, name: str) -> ModuleType:
    """The Python file at `path` imported as module `name` (registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def module_from_source(source: str, name: str, where: Path | None = None) -> ModuleType:
    """`source` written to `name`.py in `where` (a new temporary directory by default) and imported
    from there: Triton reads a kernel's source from its file, so an edited kernel needs one."""
    path = Path(where or tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    return module_from_file(path, name)


def edited_module(module: ModuleType, edits, name: str, where: Path | None = None) -> ModuleType:
    """A copy of `module`'s source with `edits` made ((old, new) pairs, each once in it), imported
    as `name` from a file of its own (module_from_source)."""
    source = Path(module.__file__).read_text()
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"{name}: not once in {module.__name__}: {old.strip()}")
        source = source.replace(old, new)
    return module_from_source(source, name, where)
