"""What stochastic rounding costs the fused update, and what its generator does to that cost: at
the update's timing shapes that round stochastically (SGD on bf16 weights), the default module
beside copies edited from its source:

- "philox, one call an element": each weight's draw the first of a Philox call of its own (the
  kernel before the four-a-call draws of `_uniform`);
- "hash": each weight's draw from an integer hash of its place and the seed (two multiplies,
  against Philox's ten rounds), for the cost of a cheaper generator;
- "nearest": the default module rounding to nearest (stochastic_rounding off): the floor.

Every stochastic result passes the problem's verify (each weight one of the two values around
the exact step, rounded up about as often as its place between them says); each module is timed
twice, alternately, and the rows kernel's registers printed. One CUDA device.

    python3 -m evals.studies.update_rounding [SHAPE NAME SUBSTRING]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import kernels.embedding_bags_update as kernel
from evals.studies import module_from_source
from evals.studies.update_phases import _compiled
from sandbox.timing import benchmark
from search_space import get_problem

DRAW = "        up = _uniform(seed, where) < frac\n"
EACH = "        up = tl.rand(seed, where) < frac\n"
HASH_BODY = """    lo = (where & 0xFFFFFFFF).to(tl.uint32)
    hi = (where >> 32).to(tl.uint32)
    x = lo ^ (hi * tl.full([], 0x9E3779B9, tl.uint32))
    x ^= seed.to(tl.uint32) * tl.full([], 0x85EBCA6B, tl.uint32)
    x ^= x >> 16
    x *= tl.full([], 0x7FEB352D, tl.uint32)
    x ^= x >> 15
    x *= tl.full([], 0x846CA68B, tl.uint32)
    x ^= x >> 16
    return tl.random.uint_to_uniform_float(x)


@triton.jit
def _round("""


def _edited(name: str, old: str, new: str):
    source = Path(kernel.__file__).read_text()
    if source.count(old) != 1:
        raise SystemExit(f"{name}: the line to edit is not once in kernels/embedding_bags_update.py: {old!r}")
    return module_from_source(source.replace(old, new), name)


def _hash_module():
    """The default with `_uniform`'s body after its docstring replaced by HASH_BODY."""
    source = Path(kernel.__file__).read_text()
    start = source.index("def _uniform(")
    body = source.index('"""', source.index('"""', start) + 3) + 4
    end = source.index("@triton.jit\ndef _round(", body)
    return module_from_source(source[:body] + HASH_BODY + source[end + len("@triton.jit\ndef _round(") :],
                              "_update_hash")  # fmt: skip


def main(pattern: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    variants = [
        ("default (philox, four a call)", kernel, True),
        ("philox, one call an element", _edited("_update_each", DRAW, EACH), True),
        ("hash", _hash_module(), True),
        ("nearest", kernel, False),
    ]
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
        for label, module, _ in variants[:3]:
            print(label, *_compiled(module._rows_kernel), sep="\n  ")
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
