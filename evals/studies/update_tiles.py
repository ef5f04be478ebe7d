"""The fused update with and without its singles launch (rows of one id updated whole, straight
from their sorted positions: kernels.embedding_bags_update.SINGLES), and the rows kernel at
tiles that give each program more rows at once than earlier sweeps did (evals/studies/
update_phases.py swept 256 to 512 elements a program): a program's gathers are random rows,
so the bytes it has in flight between dependent loads set how much of the memory's latency is
hidden.

A variant is SINGLES on or off and knob values (BLOCK_I chunks x BLOCK_L ids x BLOCK_D columns
on num_warps warps, its loops in num_stages stages; BLOCK_P positions a singles program takes,
on SINGLES_num_warps). The whole op is timed (numbering included), its result checked against
the first variant's to an ulp of their dtype (weights and state, from the same pristine
copies), and the kernels' registers and spills printed after each shape. One CUDA device; rows
print as they are measured.

    python3 -m evals.studies.update_tiles [SHAPE NAME SUBSTRING] [DTYPE] [OTHER MODULES]

Other versions' modules (comma-separated), if named, are timed first (their defaults), and the
rest against the first of them.
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


def _singles(p: int, w: int) -> dict:
    return {"BLOCK_P": p, "SINGLES_num_warps": w}


# (label, SINGLES, knobs); the first is the rows kernel alone at its default tile.
VARIANTS = (
    ("rows kernel alone", False, {}),
    ("singles 8 w4", True, _singles(8, 4)),
    ("singles 4 w2", True, _singles(4, 2)),
    ("singles 8 w2", True, _singles(8, 2)),
    ("rows 16x1x32 w2", False, _tile(16, 1, 32, 2)),
    ("rows 16x1x64 w2", False, _tile(16, 1, 64, 2)),
    # Software-pipelined loops: a column block's (or a step's) gathers issued while the last's
    # are summed.
    ("rows 8x1x32 w2 s2", False, _tile(8, 1, 32, 2, 2)),
)


def _set(singles: bool, knobs: dict, base: dict) -> None:
    kernel.SINGLES = singles
    kernel.KNOBS.update(base, **knobs)


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
    base, singles = dict(kernel.KNOBS), kernel.SINGLES
    for shape in problem.timing_shapes:
        if pattern not in shape.name or (dtype and shape.dtype != dtype):
            continue
        inputs = problem.make_inputs(shape, 1, device)
        # Pristine copies: the timed calls update the inputs' own weights and state.
        weights, state = inputs.args[0].clone(), inputs.args[1].clone()
        print(f"\n{shape.describe()}: {inputs.args[6].numel():,} ids", flush=True)
        expected, first = None, None
        variants = [(name, None, {}) for name in others.split(",") if name]
        for label, on, knobs in variants + list(VARIANTS):
            _set(singles if on is None else on, knobs, base)
            module = importlib.import_module(label) if on is None else kernel
            got = _updated(module, inputs, weights, state)
            expected = expected or got
            same = all(_close(g, e) for g, e in zip(got, expected, strict=True))
            del got
            call = [(inputs.args, inputs.kwargs)]
            us = benchmark(module.embedding_bags_update, call, device=device, max_reps=10).median_us
            first = first or us
            check = "ok" if same else "DIFFERS from the first"
            print(f"  {label:20} {us:9.1f} us  {first / us:5.2f}x the first  {check}", flush=True)
        _set(singles, {}, base)
        for line in _compiled(kernel._rows_kernel):
            print(line)
        del inputs, expected
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
