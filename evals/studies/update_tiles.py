"""The fused update's rows kernel at tiles that give each program more rows at once than earlier
sweeps did (evals/studies/update_phases.py swept 256 to 512 elements a program), beside other
versions of the module: a program's gathers are random rows, so the bytes it has in flight
between dependent loads set how much of the memory's latency is hidden.

A tile is BLOCK_I chunks x BLOCK_L ids x BLOCK_D columns on num_warps warps, its loops in
num_stages stages. The whole op is timed (numbering included), its result checked against the
first row's to an ulp of its dtype (weights and state, from the same pristine copies), and the
rows kernel's registers and spills printed after each shape. One CUDA device; rows print as
they are measured.

    python3 -m evals.studies.update_tiles [SHAPE NAME SUBSTRING] [DTYPE] [OTHER MODULES]

Other versions' modules (comma-separated, each a copy of kernels/embedding_bags_update.py under
evals/studies), if named, are timed first at their defaults, and the rest against the first.
"""

from __future__ import annotations

import importlib
import sys

import torch

import kernels.embedding_bags_update as kernel
from evals.studies.update_phases import _compiled
from sandbox.timing import benchmark
from search_space import get_problem


def _tile(i: int, l: int, d: int, w: int, s: int = 1) -> dict:  # noqa: E741
    return {"BLOCK_I": i, "BLOCK_L": l, "BLOCK_D": d, "num_warps": w, "num_stages": s}


# (label, knobs); the first is the default tile.
TILES = (
    ("default tile", {}),
    ("16x1x32 w2", _tile(16, 1, 32, 2)),
    ("32x1x32 w4", _tile(32, 1, 32, 4)),
    ("16x1x64 w2", _tile(16, 1, 64, 2)),
    # Software-pipelined loops: a column block's (or a step's) gathers issued while the last's
    # are summed.
    ("8x1x32 w2 s2", _tile(8, 1, 32, 2, 2)),
)


def _updated(module, inputs, weights, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and state after one call of module's update, from copies of the pristine ones."""
    w, s = weights.clone(), state.clone()
    module.embedding_bags_update(w, s, *inputs.args[2:], **inputs.kwargs)
    return w, s


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal within a unit in the last place of their dtype (twice fp32's): sums of a row's norm in
    another order move adagrad's state by an ulp, and its step the weights by an ulp of theirs."""
    rtol = 2 * max(torch.finfo(got.dtype).eps, torch.finfo(torch.float32).eps)
    return torch.allclose(got.float(), expected.float(), rtol=rtol, atol=1e-7)


def main(pattern: str = "", dtype: str = "", others: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    base = dict(kernel.KNOBS)
    for shape in problem.timing_shapes:
        if pattern not in shape.name or (dtype and shape.dtype != dtype):
            continue
        inputs = problem.make_inputs(shape, 1, device)
        # Pristine copies: the timed calls update the inputs' own weights and state.
        weights, state = inputs.args[0].clone(), inputs.args[1].clone()
        print(f"\n{shape.describe()}: {inputs.args[6].numel():,} ids", flush=True)
        expected, first = None, None
        modules = [(name, importlib.import_module(name), {}) for name in others.split(",") if name]
        for label, module, knobs in modules + [(label, kernel, knobs) for label, knobs in TILES]:
            kernel.KNOBS.update(base, **knobs)
            got = _updated(module, inputs, weights, state)
            expected = expected or got
            same = all(_close(g, e) for g, e in zip(got, expected, strict=True))
            del got
            call = [(inputs.args, inputs.kwargs)]
            us = benchmark(module.embedding_bags_update, call, device=device, max_reps=10).median_us
            first = first or us
            check = "ok" if same else "DIFFERS from the first"
            print(f"  {label:20} {us:9.1f} us  {first / us:5.2f}x the first  {check}", flush=True)
        kernel.KNOBS.update(base)
        for line in _compiled(kernel._rows_kernel):
            print(line)
        del inputs, expected
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
