"""What stochastic rounding costs the fused update: at the update's timing shapes that round
stochastically (SGD on bf16 weights), the default module beside other versions of it (copies
under evals/studies, e.g. `git show 8ccde80:kernels/embedding_bags_update.py >
evals/studies/_update_before.py`: a Philox call for each weight's draw, rounded toward zero and
then up by comparing the remainder's fraction with a uniform draw) and beside itself rounding
to nearest (stochastic_rounding off: the floor).

Every stochastic result passes the problem's verify (each weight one of the two values around
the exact step, rounded up about as often as its place between them says); each version is timed
twice, alternately, and the rows kernel's registers printed. One CUDA device.

    python3 -m evals.studies.update_rounding [SHAPE NAME SUBSTRING] [OTHER MODULES]
"""

from __future__ import annotations

import importlib
import sys

import torch

import kernels.embedding_bags_update as kernel
from evals.studies.update_phases import _compiled
from sandbox.timing import benchmark
from search_space import get_problem


def main(pattern: str = "", others: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    variants = [("default", kernel, True)]
    variants += [(name, importlib.import_module(name), True) for name in others.split(",") if name]
    variants += [("default, to nearest", kernel, False)]
    for shape in problem.timing_shapes:
        if pattern not in shape.name or not shape.params.get("stochastic_rounding"):
            continue
        inputs = problem.make_inputs(shape, 1, device)
        print(f"\n{shape.describe()}: {inputs.args[6].numel():,} ids", flush=True)
        first = None
        for label, module, stochastic in variants * 2:
            kwargs = dict(inputs.kwargs, stochastic_rounding=stochastic)
            check = "-"
            if stochastic:
                got = inputs.clone()
                module.embedding_bags_update(*got.args, **kwargs)
                message = problem.verify(inputs, (got.args[0], got.args[1]))
                check = "ok" if message is None else f"WRONG: {message[:70]}"
                del got
            call = [(inputs.clone().args, kwargs)]
            us = benchmark(module.embedding_bags_update, call, device=device, max_reps=10).median_us
            first = first or us
            print(f"  {label:32} {us:9.1f} us  {first / us:5.2f}x the first  {check}", flush=True)
        for label, module, _ in variants[:-1]:
            print(label, *_compiled(module._rows_kernel), sep="\n  ")
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
