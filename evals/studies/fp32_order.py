"""Bag-major block order in fp32 where the output's rows start off 32-byte sectors. The lookup
chooses it only in 16-bit types (embedding_bags._bags_major): in fp32 it was timed only in a
form that chose the order inside the kernel, with costs of its own (1.29x at b128k-f20-short
with a dim-4 feature, 0.91x at b64k-f40-mixed with one). Here the default beside a copy whose
rule drops the 16-bit condition, by the profiler (lookup_profile.beside), at narrow_order's fp32
shapes (each timing shape with a dim-4 feature, then the aligned timing shapes, where both
versions compile the same code); outputs checked bit for bit.

    python3 -m evals.studies.fp32_order

One CUDA device; rows print as they are measured.
"""

from __future__ import annotations

import kernels.embedding_bags as kernel
from evals.studies import edited_module
from evals.studies.lookup_profile import beside
from evals.studies.narrow_order import shapes

ANY_DTYPE = [
    (
        "    return element_size == 2 and total_dim * element_size % 32 != 0\n",
        "    return total_dim * element_size % 32 != 0\n",
    )
]


def main() -> None:
    versions = [("default", kernel), ("bag-major fp32", edited_module(kernel, ANY_DTYPE, "_bags_fp32_major"))]
    beside(versions, [s for s in shapes() if s.dtype == "fp32"], check=True)


if __name__ == "__main__":
    main()
