"""Which forward tiles compile and agree with the reference for jagged_attention's small-head,
relative-bias check shapes (ptxas has crashed on the default one at head dim 16, bf16), each
tried in a process of its own so that a compiler crash ends only that try.

    python3 -m evals.studies.probe_bias_tiles [--shape bias-clamped] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

TILES = [
    None,  # the launcher's own choice
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
]


def try_tile(shape_name: str, dtype: str, tile: dict | None) -> dict:
    """One forward at `shape_name` with `tile` forced on the launcher, against the reference."""
    import torch

    from kernels import ops
    from kernels.kit import attention
    from sandbox.protocol import compare, fresh_seed
    from search_space import get_problem

    problem = get_problem("jagged_attention")
    shape = next(s for s in problem.check_shapes if s.name == shape_name and s.dtype == dtype)
    if tile is not None:
        attention._forward_config = lambda *a, **k: dict(tile)
    inputs = problem.make_inputs(shape, fresh_seed(), torch.device("cuda"))
    got = ops.jagged_attention(*inputs.args, **inputs.kwargs)
    torch.cuda.synchronize()
    ref = problem.reference(*inputs.args, **inputs.kwargs)
    ok, detail = compare(got, ref, *problem.closeness(shape.dtype, inputs, ref))
    return {"ok": ok, "detail": detail.get("message", "")}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="bias-clamped")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's tile, as JSON
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(try_tile(args.shape, args.dtype, json.loads(args.one))))
        return
    for tile in TILES:
        argv = [sys.executable, "-m", "evals.studies.probe_bias_tiles", "--shape", args.shape,
                "--dtype", args.dtype, "--one", json.dumps(tile)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        outcome = (
            done.stdout.strip().splitlines()[-1]
            if done.returncode == 0
            else (f"exit {done.returncode}: " + " | ".join(done.stderr.strip().splitlines()[-2:])[-300:])
        )
        print(f"{json.dumps(tile)}\t{outcome}", flush=True)


if __name__ == "__main__":
    main()
