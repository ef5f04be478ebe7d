"""The table-batched lookup's forward kernel by the profiler, beside other versions of its module,
alternately, three times, at each timing shape: device time, which leaves out the host's launch
gaps and the clocks' drift between samples (wall-clock timings of the same calls spread by 5 to
10% in some runs on the H100 this was written on, where the kernels' device times agreed within
0.2%). The outputs are checked by evals/studies/beside.py and `bench ops`; this times only.

    git show COMMIT:kernels/embedding_bags.py > evals/studies/_bags_before.py
    python3 -m evals.studies.lookup_profile evals.studies._bags_before[,OTHERS] [SHAPE NAME SUBSTRING] [DTYPE]

One CUDA device; rows print as they are measured.
"""

from __future__ import annotations

import importlib
import sys

import torch

import kernels.embedding_bags as kernel
from evals.studies.update_profile import profiled
from search_space import get_problem

ROUNDS = 3


def forward_kernel_us(module, inputs) -> float:
    """Device microseconds of the forward kernel in one call of module's embedding_bags_forward."""
    return sum(us for key, us in profiled(module.embedding_bags_forward, inputs) if "fwd_kernel" in key)


def beside(versions: list, shapes, check: bool = False) -> None:
    """At each of `shapes`: with `check`, each version's output against the first's (bit for
    bit), then every version's forward kernel ((label, module) pairs), alternately, ROUNDS times."""
    device = torch.device("cuda")
    problem = get_problem("embedding_bags")
    for shape in shapes:
        inputs = problem.make_inputs(shape, 1, device)
        print(f"\n{shape.name} {shape.dtype}", flush=True)
        if check:
            expected = versions[0][1].embedding_bags_forward(*inputs.args, **inputs.kwargs)
            total_dim = expected.shape[1]
            print(f"  total dim {total_dim} ({total_dim % 16} past 16)", flush=True)
            for label, module in versions[1:]:
                same = torch.equal(module.embedding_bags_forward(*inputs.args, **inputs.kwargs), expected)
                print(f"  {label}: output {'equal' if same else 'DIFFERS'}", flush=True)
            del expected
        for _ in range(ROUNDS):
            for label, module in versions:
                print(f"  {label:32} {forward_kernel_us(module, inputs):9.1f} us", flush=True)
        del inputs
        torch.cuda.empty_cache()


def main(others: str, pattern: str = "", dtype: str = "") -> None:
    versions = [(name, importlib.import_module(name)) for name in others.split(",") if name]
    versions.append(("default", kernel))
    shapes = get_problem("embedding_bags").timing_shapes
    beside(versions, [s for s in shapes if pattern in s.name and (not dtype or s.dtype == dtype)])


if __name__ == "__main__":
    main(*sys.argv[1:])
