"""What a feature of 4 columns costs a bf16 batch (WORKLOAD.md: dims from 4 to 256 mixed in one
batch). In bf16 a row of 4 is 8 bytes: with one such feature, the output's (and grad_out's)
rows of odd samples start off 16-byte boundaries, and so do the rows of every feature after it.
The embedding kernels move rows in 16-byte vectors only where a block's starts allow, so such a
batch may take their misaligned path everywhere, which no timing shape reaches.

Each bf16 timing shape of the lookup and of the fused update is timed as it is and with one
short feature of 4 columns (a table of 10,000 rows) appended: the added bytes are a fraction of
a percent, so the shares of the copy bandwidth compare directly. The lookup's outputs are
checked against the reference; another version of the update, against the default's result.
One CUDA device.

    python3 -m evals.studies.odd_dims [SHAPE NAME SUBSTRING] [LOOKUP MODULE] [UPDATE MODULE]
"""

from __future__ import annotations

import importlib
import sys

import torch

from evals.bench_ops import measure_copy_bandwidth
from evals.studies.update_tiles import _close, _updated
from sandbox.protocol import compare
from sandbox.timing import benchmark
from search_space import get_problem
from search_space.embedding_bags import layout_of, with_narrow_feature
from search_space.template import get_template


def main(pattern: str = "", lookup_other: str = "", update_other: str = "") -> None:
    """Each shape's default kernel, and after it another version of its module if named (a copy
    under evals/studies); the update's other version checked against the default's result."""
    device = torch.device("cuda")
    copy_bw = measure_copy_bandwidth(device)
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    for name, other in (("embedding_bags", lookup_other), ("embedding_bags_update", update_other)):
        problem, template = get_problem(name), get_template(name)
        modules = [("default", importlib.import_module(template.source_module))]
        modules += [(other, importlib.import_module(other))] if other else []
        for base in problem.timing_shapes:
            if base.dtype != "bf16" or pattern not in base.name or 4 in layout_of(base).dims():
                continue  # (a timing shape that has a feature of 4 columns already)
            for shape in (base, with_narrow_feature(base, f"{base.name}+dim4")):
                inputs = problem.make_inputs(shape, 1, device)
                # Pristine copies: the timed calls of an update change its inputs in place.
                pristine = [a.clone() for a in inputs.args[:2]] if problem.updates else None
                want = None if problem.updates else problem.reference(*inputs.args, **inputs.kwargs)
                tol, scale = (None, None) if problem.updates else problem.closeness(shape.dtype, inputs, want)
                first = None
                for label, module in modules:
                    entry = getattr(module, template.entry)
                    if problem.updates:
                        got = _updated(module, inputs, *pristine)
                        first = first or got
                        ok = all(_close(g, f) for g, f in zip(got, first, strict=True))
                        check = "same as the default" if ok else "DIFFERS from the default"
                        del got
                    else:
                        ok, details = compare(entry(*inputs.args, **inputs.kwargs), want, tol, scale)
                        check = "ok" if ok else f"WRONG: {details['message'][:60]}"
                    call = [(inputs.args, inputs.kwargs)]
                    us = benchmark(entry, call, device=device, max_reps=20).median_us
                    share = problem.bytes(shape) / (us * 1e-6) / copy_bw
                    print(
                        f"{name:22} {shape.name:34} {label:28} {us:9.1f} us {share:5.0%}  {check}", flush=True
                    )
                del inputs, want, first, pristine
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
