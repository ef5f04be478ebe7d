"""Whether half of a misaligned output's rows can be stored in 16-byte vectors. Where a 16-bit
output's row stride is 4 past a multiple of 8 elements (a feature of 4 or 12 columns in the
row), the rows of one parity start on 16 bytes and the others 8 bytes past: the lookup stores
every row of such a block in 8-byte vectors (_pool_block's second path). "split stores" stores
them in two masked stores instead: the rows that start on 16 bytes through pointers the compiler
can see are (a pair of rows' stride, 2 x the row stride, is a multiple of 8 elements), in 16-byte
vectors, and the others in 8 bytes as before. Beside the default, by the profiler
(lookup_profile.beside), at the narrow-feature shapes of narrow_order.py whose stride is so and
at the 16-bit timing shapes; outputs checked bit for bit.

    python3 -m evals.studies.split_stores [SHAPE NAME SUBSTRING]

One CUDA device; rows print as they are measured.
"""

from __future__ import annotations

import sys

import kernels.embedding_bags as kernel
from evals.studies import edited_module
from evals.studies.lookup_profile import beside
from evals.studies.narrow_order import with_features
from search_space import get_problem

SPLIT = [
    (
        "    elif (VEC == 8) & rows & (first_col % H == 0) & (stride_out_row % H == 0):\n"
        "        _pool_rows(\n",
        "    elif (VEC == 8) & rows & (first_col % H == 0) & (stride_out_row % VEC == H):\n"
        "        _pool_rows_split(\n"
        "            weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row // H * H,\n"
        "            first_col // H * H, dim // VEC * VEC, col_block, table // VEC * VEC,\n"
        "            bags_B, limit, start_B, len_B,\n"
        "            HAS_PSW, MODE_MEAN, ACC_3D, EVICT_ROWS, NUM_STAGES,\n"
        "            BLOCK_B, BLOCK_L, BLOCK_D, FLAT, VEC,\n"
        "        )  # fmt: skip\n"
        "    elif (VEC == 8) & rows & (first_col % H == 0) & (stride_out_row % H == 0):\n"
        "        _pool_rows(\n",
    ),
    (
        "@triton.jit\ndef _flat_sums(\n",
        """@triton.jit
def _pool_rows_split(
    weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row,
    first_col, dim, col_block, table, bags_B, limit, start_B, len_B,
    HAS_PSW: tl.constexpr, MODE_MEAN: tl.constexpr, ACC_3D: tl.constexpr, EVICT_ROWS: tl.constexpr,
    NUM_STAGES: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    FLAT: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    H: tl.constexpr = VEC // 2
    cols_D = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask_D = cols_D < dim
    acc_BD = _step_sums(
        weights_ptr + table, indices_ptr, psw_ptr, dim, cols_D, col_mask_D, start_B, len_B,
        HAS_PSW, ACC_3D, EVICT_ROWS, NUM_STAGES, BLOCK_B, BLOCK_L, BLOCK_D,
    )  # fmt: skip
    if MODE_MEAN:
        acc_BD = acc_BD / tl.maximum(len_B, 1).to(tl.float32)[:, None]
    vals_BD = acc_BD.to(out_ptr.dtype.element_ty)
    live_BD = (bags_B < limit)[:, None] & col_mask_D[None, :]
    q = (first_col // H) % 2  # the parity of the rows that start on 16 bytes
    lead = (first_col + q * stride_out_row) // VEC * VEC
    pair = (2 * stride_out_row) // VEC * VEC
    on16_B = bags_B % 2 == q
    tl.store(
        out_ptr + lead + (bags_B // 2)[:, None] * pair + cols_D[None, :], vals_BD,
        mask=live_BD & on16_B[:, None],
    )  # fmt: skip
    tl.store(
        out_ptr + bags_B[:, None] * stride_out_row + first_col + cols_D[None, :], vals_BD,
        mask=live_BD & ~on16_B[:, None],
    )  # fmt: skip


@triton.jit
def _flat_sums(
""",
    ),
]


def shapes():
    timing = get_problem("embedding_bags").timing_shapes
    base = timing[0]
    narrow = [with_features(base, [4]), with_features(base, [12]), with_features(base, [4, 4, 4], first=1)]
    narrow += [with_features(s, [4]) for s in timing[2:]]
    return [s for s in [*narrow, *timing] if s.dtype != "fp32"]  # fp32 compiles the path out


def main(pattern: str = "") -> None:
    versions = [("default", kernel), ("split stores", edited_module(kernel, SPLIT, "_bags_split_stores"))]
    beside(versions, [s for s in shapes() if pattern in s.name], check=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
