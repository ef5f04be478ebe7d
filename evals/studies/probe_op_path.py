"""Times one attention forward three ways, alternating, in one process: the launcher, the public
op under no_grad, and the public op with grad mode on (inputs not requiring grad), to tell a
systematic cost of the op path from the order of rows in a longer run.

    python3 -m evals.studies.probe_op_path [--case jagged_attention/b256-n4096-power-softmax] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch

from kernels import attention, ops
from sandbox.protocol import fresh_seed
from sandbox.timing import benchmark
from search_space import get_problem


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", default="jagged_attention/b256-n4096-power-softmax")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    op, shape_name = args.case.split("/")
    problem = get_problem(op)
    shape = next(s for s in problem.timing_shapes if s.name == shape_name)
    device = torch.device("cuda")
    inputs = problem.make_inputs(shape, fresh_seed(), device)
    launcher = getattr(attention, f"{op}_forward")
    public = getattr(ops, op)

    def op_no_grad():
        with torch.no_grad():
            return public(*inputs.args, **inputs.kwargs)

    variants = {
        "launcher": lambda: launcher(*inputs.args, **inputs.kwargs),
        "kernels.ops, no_grad": op_no_grad,
        "kernels.ops": lambda: public(*inputs.args, **inputs.kwargs),
    }
    ref = variants["launcher"]()
    for name, fn in variants.items():
        assert torch.equal(fn(), ref), name
    print("| round | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    for r in range(args.rounds):
        ms = [
            benchmark(fn, [((), {})], device=device, max_reps=50).median_us / 1e3 for fn in variants.values()
        ]
        print(f"| {r} | " + " | ".join(f"{m:.3f}" for m in ms) + " |", flush=True)


if __name__ == "__main__":
    main()
