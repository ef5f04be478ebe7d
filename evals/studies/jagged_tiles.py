"""The four jagged transforms at each of their timing shapes under several launch tiles, set in
their kernels' KNOBS: the default (every knob None, kernels/<op>.py's _tile: 32 rows x 128
columns on 4 warps), the rows x BLOCK_D x warps of `tiles`, then the default again (the two
rows of one tile show the run's noise and any drift over it).
Each call is the public op (kernels.ops), dispatched to its default kernel (through an empty
library), and its output is checked against the problem's reference. One CUDA device; prints a
table per op: microseconds, GB/s and the fraction of the copy bandwidth measured in the same run.

    python3 -m evals.studies.jagged_tiles [OP NAME SUBSTRING] [SHAPE NAME SUBSTRING]
"""

from __future__ import annotations

import importlib
import itertools
import sys
import tempfile

import torch
import triton

from evals.bench_ops import measure_copy_bandwidth
from kernels import ops
from kernels.registry import DISPATCHER
from sandbox.protocol import compare
from sandbox.timing import benchmark
from search_space import get_problem
from search_space.jagged_transforms import MAX_TILE
from search_space.template import get_template

OPS = ("jagged_to_padded_dense", "dense_to_jagged", "jagged_concat", "jagged_split")
DEFAULT = (None, None, None)  # (rows, BLOCK_D, num_warps)
ROWS, BLOCK_DS, WARPS = (16, 32, 64, 128), (64, 128, 256), (2, 4, 8)
MAX_REPS = 20


def tiles(dim: int, itemsize: int) -> list[tuple]:
    """The default, every rows x BLOCK_D x warps of at most MAX_TILE elements whose BLOCK_D the
    row can use (no wider than its next power of two, 64 at least) and whose threads move 4 or 8
    16-byte vectors each (among them tiles of the row's width: a 16 KB tile of BLOCK_D the row's
    next power of two, up to 512 bytes), then the default again. Compiled variants depend on the
    dtype and the tile alone, not the shape."""
    swept = [
        (rows, block_d, warps)
        for rows, block_d, warps in itertools.product(ROWS, BLOCK_DS, WARPS)
        if rows * block_d <= MAX_TILE
        and block_d <= max(64, triton.next_power_of_2(dim))
        and 64 <= rows * block_d * itemsize // (32 * warps) <= 128
    ]
    return [DEFAULT, *swept, DEFAULT]


def study(name: str, shape_pattern: str, device: torch.device, copy_bw: float) -> None:
    problem, public = get_problem(name), ops.op(name)
    module = importlib.import_module(f"kernels.{name}")
    knobs = (get_template(name).knobs[0].name, "BLOCK_D", "num_warps")
    base = dict(module.KNOBS)
    print(
        f"\n{name}\n  {'shape':24} {'tile (rows x BLOCK_D / warps)':32} {'us':>9} {'GB/s':>7} {'copy':>5}  ok"
    )
    for shape in [s for s in problem.timing_shapes if shape_pattern in s.name]:
        inputs = problem.make_inputs(shape, 1, device)
        want = problem.reference(*inputs.args, **inputs.kwargs)
        moved = problem.bytes(shape)
        dim, itemsize = shape.params["dim"], shape.torch_dtype.itemsize
        where = f"{shape.name} {shape.dtype}"
        for tile in tiles(dim, itemsize):
            module.KNOBS.update(base, **dict(zip(knobs, tile, strict=True)))
            rows, block_d, warps = module._tile(tile[0], dim, itemsize, 0, False)  # a GPU tile: no extent
            what = "default " if tile == DEFAULT else ""
            label = f"{what}{rows} x {block_d} / {warps}"
            try:  # a tile this device or Triton cannot launch is a row of the table, not the end
                got = public(*inputs.args, **inputs.kwargs)
            except Exception as exc:  # noqa: BLE001 - reported, and the sweep goes on
                print(f"  {where:24} {label:32} FAILED: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            if DISPATCHER.last.get(name) != "default":
                raise SystemExit(f"{name} dispatched to {DISPATCHER.last.get(name)}, not its default kernel")
            ok, details = compare(got, want, problem.tolerance(shape.dtype))
            del got
            us = benchmark(public, [(inputs.args, inputs.kwargs)], device=device, max_reps=MAX_REPS).median_us
            gbs = moved / (us * 1e-6) / 1e9
            verdict = "ok" if ok else f"WRONG: {details['message'][:60]}"
            # Each row as soon as it is measured: a run cut short keeps what it timed.
            print(
                f"  {where:24} {label:32} {us:9.1f} {gbs:7.0f} {gbs * 1e9 / copy_bw:5.0%}  {verdict}",
                flush=True,
            )
        del want, inputs
    module.KNOBS.update(base)


def main(op_pattern: str = "", shape_pattern: str = "") -> None:
    device = torch.device("cuda")
    copy_bw = measure_copy_bandwidth(device)
    assert copy_bw is not None
    name = torch.cuda.get_device_name(device)
    print(f"{name}: copy {copy_bw / 1e9:.0f} GB/s; triton {triton.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as empty, DISPATCHER.library_at(empty):
        for op in [op for op in OPS if op_pattern in op]:
            study(op, shape_pattern, device, copy_bw)


if __name__ == "__main__":
    main(*sys.argv[1:])
