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


def forward_kernel_us(module, inputs) -> float:
    """Device microseconds of the forward kernel in one call of module's embedding_bags_forward."""
    return sum(us for key, us in profiled(module.embedding_bags_forward, inputs) if "fwd_kernel" in key)


def main(others: str, pattern: str = "", dtype: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags")
    versions = [(name, importlib.import_module(name)) for name in others.split(",") if name]
    versions.append(("default", kernel))
    for shape in problem.timing_shapes:
        if pattern not in shape.name or (dtype and shape.dtype != dtype):
            continue
        inputs = problem.make_inputs(shape, 1, device)
        print(f"\n{shape.name} {shape.dtype}", flush=True)
        for _ in range(3):
            for label, module in versions:
                print(f"  {label:32} {forward_kernel_us(module, inputs):9.1f} us", flush=True)
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
