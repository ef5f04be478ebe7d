"""What random row gathers can reach on this device, by row size, beside embedding_bags' forward
on bags of one id (the same bytes): how much of the copy bandwidth a lookup of short bags can
take at all, since its rows are a few dozen to a few hundred bytes each, read at random from
tables far larger than L2.

Each row size runs over a table of about 1.6 GB (the timing shapes' size) with uniformly random
ids. Providers: a plain Triton gather that copies whole rows (several tiles, the best kept), the
same gather split into 64-byte column slices, each slice its own program, as the lookup's grid
splits a row (the slices of a row are then read far apart in time), the same slices numbered
column block fastest (a row's slices read by neighbouring programs, at about the same time),
torch.index_select, and embedding_bags' forward with one feature and bags of one id, its blocks
in either order (its SLICES_TOGETHER knob). GB/s on the bytes read and written
(rows twice, and the ids); "copy" is the fraction of the device-to-device copy bandwidth
measured in the same run (the lookup's offsets, 8 bytes an id more, are not counted). One CUDA
device; prints a table (on a CPU, interpreted, it only shows that the study runs).

    python3 -m evals.studies.gather_ceiling [IDS_MILLIONS]
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

import kernels.embedding_bags as bags
from evals.bench_ops import measure_copy_bandwidth
from sandbox.timing import benchmark

TABLE_BYTES = 1.6e9
# (dtype, dim): rows of 32 to 512 bytes.
ROWS = (
    (torch.bfloat16, 16),
    (torch.bfloat16, 32),
    (torch.bfloat16, 64),
    (torch.bfloat16, 128),
    (torch.bfloat16, 256),
    (torch.float32, 16),
    (torch.float32, 64),
    (torch.float32, 128),
)
# (rows a program, warps) of the whole-row gather.
TILES = ((16, 2), (32, 2), (64, 4), (128, 4))


@triton.jit
def _gather_kernel(
    table_ptr, ids_ptr, out_ptr, n, dim, col_blocks, TOGETHER: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows of a block of ids, BLOCK_D columns of one column block, into consecutive output rows.
    The grid's second axis numbers the column blocks (one block: whole rows); TOGETHER, one axis
    numbers them fastest."""
    if TOGETHER:
        row_block, col_block = tl.program_id(0) // col_blocks, tl.program_id(0) % col_blocks
    else:
        row_block, col_block = tl.program_id(0), tl.program_id(1)
    r = row_block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = r < n
    cmask = c < dim
    ids = tl.load(ids_ptr + r, mask=rmask, other=0)
    vals = tl.load(table_ptr + ids[:, None] * dim + c[None, :], mask=rmask[:, None] & cmask[None, :])
    tl.store(out_ptr + r[:, None] * dim + c[None, :], vals, mask=rmask[:, None] & cmask[None, :])


def _gather(table, ids, dim, block_r, block_d, warps, together=False):
    n = ids.numel()
    out = torch.empty((n, dim), dtype=table.dtype, device=table.device)
    row_blocks, col_blocks = triton.cdiv(n, block_r), triton.cdiv(dim, block_d)
    grid = (row_blocks * col_blocks,) if together else (row_blocks, col_blocks)
    _gather_kernel[grid](
        table, ids, out, n, dim, col_blocks, TOGETHER=together, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=warps,
    )  # fmt: skip
    return out


def _lookup(table, one, dims, ids, offsets, dim, together):
    """embedding_bags' forward, its blocks in the given order."""
    saved = bags.KNOBS["SLICES_TOGETHER"]
    bags.KNOBS["SLICES_TOGETHER"] = together
    try:
        return bags.embedding_bags_forward(table, one, dims, ids, offsets, total_dim=dim, max_dim=dim)
    finally:
        bags.KNOBS["SLICES_TOGETHER"] = saved


def _rate(fn, arg_sets, want, moved: int, copy_bw: float | None, device: torch.device) -> str:
    """GB/s of `fn` over the id sets (checked against `want` on the first), and its fraction of
    the copy bandwidth."""
    assert torch.equal(fn(arg_sets[0]).view(want.shape), want), "gather mismatch"
    us = benchmark(fn, [((ids,), {}) for ids in arg_sets], device=device).median_us
    gbs = moved / us / 1e3
    return f"{gbs:6.0f} {gbs * 1e9 / copy_bw:5.0%}" if copy_bw else f"{gbs:6.0f}"


def _row(dtype: torch.dtype, dim: int, n: int, copy_bw: float | None, device: torch.device) -> list[str]:
    """The providers' rates at rows of `dim` elements of `dtype`."""
    elem = torch.empty((), dtype=dtype).element_size()
    rows = int(TABLE_BYTES // (dim * elem))
    table = torch.randn(rows * dim, dtype=torch.float32, device=device).to(dtype)
    gens = [torch.Generator(device=device).manual_seed(seed) for seed in range(3)]
    arg_sets = [torch.randint(0, rows, (n,), generator=g, device=device) for g in gens]
    want = table.view(rows, dim)[arg_sets[0]]
    moved = n * (2 * dim * elem + 8)
    one = torch.zeros(1, dtype=torch.long, device=device)
    dims = torch.tensor([0, dim], device=device)
    offsets = torch.arange(n + 1, device=device)
    whole_d = triton.next_power_of_2(dim)
    providers = {
        "whole": [lambda ids, r=r, w=w: _gather(table, ids, dim, r, whole_d, w) for r, w in TILES],
        "sliced": [lambda ids: _gather(table, ids, dim, 32, max(64 // elem, 1), 2)],
        "sliced together": [lambda ids: _gather(table, ids, dim, 32, max(64 // elem, 1), 2, True)],
        "index_select": [lambda ids: torch.index_select(table.view(rows, dim), 0, ids)],
        "lookup": [lambda ids: _lookup(table, one, dims, ids, offsets, dim, False)],
        "lookup together": [lambda ids: _lookup(table, one, dims, ids, offsets, dim, True)],
    }
    return [
        max(
            (_rate(fn, arg_sets, want, moved, copy_bw, device) for fn in fns),
            key=lambda s: float(s.split()[0]),
        )
        for fns in providers.values()
    ]


def main(ids_millions: float = 4.0) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    copy_bw = measure_copy_bandwidth(device)
    n = int(ids_millions * 1e6)
    print(f"copy bandwidth {(copy_bw or 0) / 1e9:.0f} GB/s; {n} random ids a call")
    names = ("whole rows", "64 B slices", "slices together", "index_select", "embedding_bags")
    names += ("bags together",)
    print(f"{'row':>13} {'bytes':>5} " + " ".join(f"{p:>14}" for p in names))
    for dtype, dim in ROWS:
        rates = _row(dtype, dim, n, copy_bw, device)
        size = dim * torch.empty((), dtype=dtype).element_size()
        print(f"{str(dtype)[6:]:>8} d{dim:<3} {size:>5} " + " ".join(f"{r:>14}" for r in rates))
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*[float(a) for a in sys.argv[1:]])
