"""A problem's default kernel module beside another version of it (a copy under evals/studies, e.g.
`git show COMMIT:kernels/embedding_bags.py > evals/studies/_bags_before.py`), at each timing
shape: both outputs checked against the reference, then each timed twice, alternately, so that
drift of the clocks shows as disagreement between a module's two figures. For problems that
return an output (not updates in place: evals/studies/update_tiles.py times the update). One
CUDA device; rows print as they are measured.

    python3 -m evals.studies.beside PROBLEM OTHER_MODULE [SHAPE NAME SUBSTRING]
"""

from __future__ import annotations

import importlib
import sys

import torch

from sandbox.protocol import compare
from sandbox.timing import benchmark
from search_space import get_problem
from search_space.template import get_template


def main(problem_name: str, other: str, pattern: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem(problem_name)
    if problem.updates:
        raise SystemExit(f"{problem_name} updates its arguments in place: time it with update_tiles")
    template = get_template(problem_name)
    modules = {other: other, "default": template.source_module}
    entries = {label: getattr(importlib.import_module(m), template.entry) for label, m in modules.items()}
    for shape in [s for s in problem.timing_shapes if pattern in s.name]:
        inputs = problem.make_inputs(shape, 1, device)
        call = (inputs.args, inputs.kwargs)
        want = problem.reference(*inputs.args, **inputs.kwargs)
        tol, scale = problem.closeness(shape.dtype, inputs, want)
        print(f"\n{shape.describe()}", flush=True)
        first = None
        for label, fn in list(entries.items()) * 2:
            ok, details = compare(fn(*call[0], **call[1]), want, tol, scale)
            us = benchmark(fn, [call], device=device).median_us
            first = first or us
            check = "ok" if ok else f"WRONG: {details['message'][:60]}"
            print(f"  {label:40} {us:9.1f} us  {first / us:5.2f}x the first  {check}", flush=True)
        del inputs, want
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
