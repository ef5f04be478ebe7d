"""The fused update's device time by the profiler, at each timing shape: the default's kernels one
by one (the numbering's torch ops and kernels, the rows kernel, the long rows), then the rows
kernel and all kernels of one call beside other versions of the module, alternately, twice.
Device time, not wall time: it leaves out the host's launch gaps and the clocks' drift between
samples, so two versions a percent apart read apart (wall-clock timings of the same calls spread
by up to 30% on the H100 this was written on).

Each version's result is checked against the first's (weights and state, to an ulp of their
dtype, from the same pristine copies). Another version is a copy of kernels/embedding_bags_update.py
under evals/studies; to hold its numbering too, point its import of the kit at a copy of
the kit's module:

    git show COMMIT:kernels/embedding_bags_update.py > evals/studies/_update_before.py
    git show COMMIT:kernels/kit/embeddings.py > evals/studies/_kit_before.py
    sed -i 's/from kernels.kit.embeddings import/from evals.studies._kit_before import/' \\
        evals/studies/_update_before.py
    python3 -m evals.studies.update_profile [SHAPE NAME SUBSTRING] [OTHER MODULES, comma-separated]

One CUDA device; rows print as they are measured.
"""

from __future__ import annotations

import importlib
import sys

import torch

import kernels.embedding_bags_update as kernel
from evals.studies.update_phases import _compiled
from evals.studies.update_tiles import _close, _updated
from search_space import get_problem

CALLS = 5


def profiled(fn, inputs) -> list[tuple[str, float]]:
    """(kernel name, device microseconds per call) of each kernel of `fn`'s calls on `inputs`,
    most first (lookup_profile.py uses it too)."""
    for _ in range(2):
        fn(*inputs.args, **inputs.kwargs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn(*inputs.args, **inputs.kwargs)
        torch.cuda.synchronize()
    found = [(e.key, e.self_device_time_total / CALLS) for e in prof.key_averages()]
    return sorted([(key, us) for key, us in found if us > 0], key=lambda row: -row[1])


def main(pattern: str = "", others: str = "") -> None:
    versions = [(name, importlib.import_module(name)) for name in others.split(",") if name]
    beside([*versions, ("default", kernel)], pattern)


def beside(versions: list, pattern: str = "", kernel_name: str = "_rows_kernel") -> None:
    """The default's kernels one by one, then `kernel_name` and all kernels of each version
    ((label, module) pairs), alternately, twice, at each timing shape whose name holds `pattern`."""
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    for shape in problem.timing_shapes:
        if pattern not in shape.name:
            continue
        inputs = problem.make_inputs(shape, 1, device)
        weights, state = inputs.args[0].clone(), inputs.args[1].clone()
        print(f"\n{shape.name} {shape.dtype}: {inputs.args[6].numel():,} ids", flush=True)
        kernels = profiled(kernel.embedding_bags_update, inputs)
        for key, us in kernels:
            print(f"  default: {key[:70]:70} {us:9.1f} us", flush=True)
        print(f"  default: {'all kernels':70} {sum(us for _, us in kernels):9.1f} us", flush=True)
        expected = None
        for _ in range(2):
            for label, module in versions:
                got = _updated(module, inputs, weights, state)
                expected = expected or got
                same = all(_close(g, e) for g, e in zip(got, expected, strict=True))
                del got
                kernels = profiled(module.embedding_bags_update, inputs)
                one = sum(us for key, us in kernels if key.startswith(kernel_name))
                total = sum(us for _, us in kernels)
                check = "ok" if same else "DIFFERS from the first"
                line = f"  {label:32} {kernel_name} {one:8.1f} us  all kernels {total:8.1f} us  {check}"
                print(line, flush=True)
        del inputs, expected
        torch.cuda.empty_cache()
    for label, module in versions:
        for line in _compiled(module._rows_kernel):
            print(f"{label}{line}")


if __name__ == "__main__":
    main(*sys.argv[1:])
