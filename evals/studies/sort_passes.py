"""The kit's radix sort (kernels/kit/sort.py) in several configurations beside torch's stable sort,
on the keys of the fused update's timing shapes (each id's row key, as sort_by_row makes them),
by device time (the profiler's, all kernels of a call): a pass's digit width (8, 10 or 11 bits:
fewer passes, more counts), the keys a program places, and the ranking (a sort on chip, or
counts for 4-bit digits). Each result is checked equal to torch's.

    python3 -m evals.studies.sort_passes [SHAPE NAME SUBSTRING]

One CUDA device; rows print as they are measured.
"""

from __future__ import annotations

import sys

import torch
import triton

import kernels.kit.embeddings as numbering
import kernels.kit.sort as sort
from evals.studies.update_profile import profiled
from search_space import get_problem

CONFIGS = {
    "8 bits, 2048 a block": {"DIGIT_BITS": 8, "BLOCK": 2048, "BY_SORT": True},
    "8 bits, 1024 a block": {"DIGIT_BITS": 8, "BLOCK": 1024, "BY_SORT": True},
    "8 bits, 4096 a block": {"DIGIT_BITS": 8, "BLOCK": 4096, "BY_SORT": True},
    "10 bits, 2048 a block": {"DIGIT_BITS": 10, "BLOCK": 2048, "BY_SORT": True},
    "11 bits, 4096 a block": {"DIGIT_BITS": 11, "BLOCK": 4096, "BY_SORT": True},
    "4 bits counted, 1024": {"DIGIT_BITS": 4, "BLOCK": 1024, "BY_SORT": False},
}


class _Call:
    def __init__(self, *args):
        self.args, self.kwargs = args, {}


def main(pattern: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    for shape in problem.timing_shapes:
        if pattern not in shape.name:
            continue
        inputs = problem.make_inputs(shape, 1, device)
        weights, state, _, _, row_offsets, _, indices, offsets = inputs.args
        rows = state.numel() if state.numel() else weights.numel()
        batch = (offsets.numel() - 1) // row_offsets.numel()
        bag = numbering.bags_of(offsets, indices.numel())
        keys = torch.empty(indices.numel(), dtype=torch.int32, device=device)  # in the ids' order
        numbering._keys_kernel[(triton.cdiv(keys.numel(), 1024),)](
            row_offsets, indices, bag, keys, keys.numel(), batch, BLOCK=1024
        )
        bits = max(rows - 1, 1).bit_length()
        print(f"\n{shape.name} {shape.dtype}: {keys.numel():,} keys of {bits} bits", flush=True)
        want = torch.sort(keys, stable=True)
        calls = profiled(lambda k: torch.sort(k, stable=True), _Call(keys))
        print(f"  {'torch.sort (stable)':28} {sum(us for _, us in calls):8.1f} us", flush=True)
        for label, config in CONFIGS.items():
            sort.CONFIG = config
            got = sort.sort_pairs(keys, bits)
            same = torch.equal(got[0], want.values) and torch.equal(got[1].long(), want.indices)
            calls = profiled(sort.sort_pairs, _Call(keys, bits))
            parts = "  ".join(f"{key.split('_kernel')[0].lstrip('_')} {us:.1f}" for key, us in calls)
            check = "ok" if same else "DIFFERS from torch"
            print(f"  {label:28} {sum(us for _, us in calls):8.1f} us  {check}  ({parts})", flush=True)
        del inputs, keys, want
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
