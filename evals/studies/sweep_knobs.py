"""Sweep a template's knobs in one process on the GPU: render, check once against the
reference, time on the problem's timing shapes. A quick map of the space before a campaign
(the campaign's sandbox remains the only judge of acceptance).

    python3 -m evals.studies.sweep_knobs embedding_bag --samples 40 --dtype bf16
"""

from __future__ import annotations

import argparse
import itertools
import random
from statistics import geometric_mean

import torch

from evals.studies import module_from_source
from sandbox.protocol import compare, fresh_seed
from sandbox.timing import benchmark
from search_space import get_problem
from search_space.template import get_template


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("problem")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fix", action="append", default=[], help="KNOB=VALUE (python literal)")
    args = parser.parse_args()
    problem, template = get_problem(args.problem), get_template(args.problem)
    device = torch.device("cuda")
    fixed = {}
    for item in args.fix:
        k, v = item.split("=", 1)
        fixed[k] = eval(v)  # noqa: S307 - a developer's own command line
    space = [
        dict(zip([k.name for k in template.knobs], values, strict=True))
        for values in itertools.product(*[k.choices for k in template.knobs])
    ]
    space = [s for s in space if all(s[k] == v for k, v in fixed.items())]
    valid = []
    for knobs in space:
        try:
            template.validate(knobs)
            valid.append(knobs)
        except ValueError:
            pass
    random.Random(args.seed).shuffle(valid)
    points = [template.defaults() | fixed] + valid[: args.samples]
    shapes = [s for s in problem.timing_shapes if args.dtype in (None, s.dtype)]
    inputs = {
        s.name + s.dtype: [problem.make_inputs(s, fresh_seed(), device) for _ in range(2)] for s in shapes
    }
    refs = {k: problem.reference(*v[0].args, **v[0].kwargs) for k, v in inputs.items()}
    results = []
    for i, knobs in enumerate(points):
        mod = module_from_source(template.render(knobs), f"sweep_{i}")
        fn = getattr(mod, template.entry)
        row = []
        for s in shapes:
            key = s.name + s.dtype
            first = inputs[key][0]
            ok, det = compare(
                fn(*first.args, **first.kwargs), refs[key], *problem.closeness(s.dtype, first, refs[key])
            )
            if not ok:
                row.append(float("nan"))
                continue
            st = benchmark(fn, [(x.args, x.kwargs) for x in inputs[key]], device=device, target_ms=100)
            row.append(problem.bytes(s) / (st.median_us * 1e-6) / 1e9)
        results.append((knobs, row))
        print(f"{i:3d} " + " ".join(f"{g:7.0f}" for g in row) + f"  {knobs}", flush=True)
    print("\nbest by geometric mean GB/s over " + ", ".join(s.name + "/" + s.dtype for s in shapes))

    def gm(row: list[float]) -> float:  # a failed shape (NaN) counts as nearly zero
        return geometric_mean([g if g == g else 1e-9 for g in row])

    for knobs, row in sorted(results, key=lambda kr: -gm(kr[1]))[:10]:
        print(f"{gm(row):7.0f} " + " ".join(f"{g:7.0f}" for g in row) + f"  {knobs}")


if __name__ == "__main__":
    main()
