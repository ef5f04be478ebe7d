"""The fused update's resolving kernel (_sorted_kernel: each sorted position resolved, the chunks
numbered and their records written), in variants made by edits of kernels/embedding_bags_update.py,
beside the default by the profiler (update_profile.beside: device time of that kernel and of all
the call's kernels, each version's result checked against the default's):

- "int32 bags": each id's bag, feature and sample in int32 (an int32 division by the batch in
  place of an int64 one; the kit's bags are int32 below 2^31 of them), the gradient row's place
  in the places' type;
- "8 warps": the launch on 8 warps (4 by default) for its thousand positions a program;
- both.

    python3 -m evals.studies.update_resolve [SHAPE NAME SUBSTRING]

The edits apply to the module up to 1ba1f0f; since 919b68e its default holds both (on an
H100, 1.30x to 1.35x that kernel: BENCHMARKS.md, 2026-12-07, thirty-seventh session).

One CUDA device; rows print as they are measured.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import kernels.embedding_bags_update as kernel
from evals.studies import edited_module
from evals.studies.update_profile import beside

INT32_BAGS = (
    (
        "    b = tl.load(bag_ptr + i, mask=valid, other=0).to(tl.int64)\n",
        "    b = tl.load(bag_ptr + i, mask=valid, other=0)\n",
    ),
    (
        "    grad_at = ((b - f * batch) * stride_grad + col0).to(grad_at_ptr.dtype.element_ty)\n",
        "    place = grad_at_ptr.dtype.element_ty\n"
        "    grad_at = (b - f * batch).to(place) * stride_grad + col0.to(place)\n",
    ),
)
EIGHT_WARPS = ((" VEC=vec, BLOCK=CHUNK_BLOCK,\n", " VEC=vec, BLOCK=CHUNK_BLOCK, num_warps=8,\n"),)
VARIANTS = {"int32 bags": INT32_BAGS, "8 warps": EIGHT_WARPS, "both": INT32_BAGS + EIGHT_WARPS}


def main(pattern: str = "") -> None:
    with tempfile.TemporaryDirectory() as where:
        versions = [
            (name, edited_module(kernel, edits, f"_update_{name.replace(' ', '_')}", Path(where)))
            for name, edits in VARIANTS.items()
        ]
        beside([*versions, ("default", kernel)], pattern, kernel_name="_sorted_kernel")


if __name__ == "__main__":
    main(*sys.argv[1:])
