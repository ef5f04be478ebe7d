"""The update's bag of every id: the kit's default (kernels.kit.embeddings.bags_of: each bag
that holds ids marks its first, then a running maximum over blocks of 2048 ids, each block's
carry found by one search; its work is the ids' and bags' number) against

- "search": a binary search per id over all bags' ends (log2(bags) dependent loads; the kit's
  default until the thirty-fifth session: 64 us at the short bf16 shape on an H100);
- "scatter 4 a step": each bag writes its number at its ids' positions, 4 a step, so no load
  depends on another; but a program's work is its block's longest bag (every id in one bag:
  42 ms; a step at a time, 1024 bags a program, 25 us at the short shape but 0.39 s there);
- "two levels": the bag of each block's first position by a search per block (a few thousand),
  then each position searches its block's bags only (log2 of the bags in 1024 ids).

(A count of the bags' ends by torch's index_add_ and a cumsum ran 44 to 78 us at the timing
shapes and 0.93 ms with every id in one bag: its atomic adds all hit two places.)

Each against the default's output (equal, or the run stops), then timed, at each update timing
shape's bags and at two skewed ones: every id in one bag, and an id per bag. One CUDA device;
rows print as they are measured.

    python3 -m evals.studies.update_bags
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels.kit.embeddings as numbering
from sandbox.timing import benchmark
from search_space import get_problem

BLOCK = 1024


@triton.jit
def _bag_search(offsets_ptr, pos, lo, hi, steps):
    """The bag of each position among bags [lo, hi) that holds it: lo plus how many of those
    end at or before it (an empty bag ends where it starts, so it is no id's), by `steps`
    halvings."""
    for _ in range(steps):
        mid = (lo + hi) // 2
        past = (lo < hi) & (tl.load(offsets_ptr + mid + 1, mask=lo < hi, other=0) <= pos)
        lo, hi = tl.where(past, mid + 1, lo), tl.where(past, hi, mid)
    return lo


@triton.jit
def _search_kernel(offsets_ptr, bag_ptr, nnz, num_bags, steps, BLOCK: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    tl.store(bag_ptr + pos, _bag_search(offsets_ptr, pos, lo, lo + num_bags, steps), mask=pos < nnz)


@triton.jit
def _scatter_kernel(offsets_ptr, bag_ptr, num_bags, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr):
    bags_B = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    live_B = bags_B < num_bags
    start_B = tl.load(offsets_ptr + bags_B, mask=live_B, other=0).to(tl.int64)
    len_B = tl.load(offsets_ptr + bags_B + 1, mask=live_B, other=0).to(tl.int64) - start_B
    steps_L = tl.arange(0, BLOCK_L)
    value_BL = tl.broadcast_to(bags_B[:, None], (BLOCK_B, BLOCK_L)).to(bag_ptr.dtype.element_ty)
    for j in tl.range(0, tl.max(len_B, axis=0), BLOCK_L):
        at_BL = j + steps_L[None, :]
        tl.store(bag_ptr + start_B[:, None] + at_BL, value_BL, mask=at_BL < len_B[:, None])


@triton.jit
def _firsts_kernel(
    offsets_ptr, firsts_ptr, blocks, num_bags, steps, BLOCK: tl.constexpr, LANES: tl.constexpr
):
    """firsts[k] = the bag of position k * BLOCK, for every block k; firsts[blocks] = num_bags."""
    k = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
    lo = tl.zeros([LANES], dtype=tl.int64)
    first = _bag_search(offsets_ptr, k * BLOCK, lo, lo + num_bags, steps)
    tl.store(firsts_ptr + k, tl.where(k < blocks, first, num_bags), mask=k <= blocks)


@triton.jit
def _within_kernel(offsets_ptr, firsts_ptr, bag_ptr, nnz, num_bags, BLOCK: tl.constexpr):
    """The bag of each position of block k, searched among the bags from firsts[k] to
    firsts[k + 1] (the bag of the next block's first position) alone."""
    k = tl.program_id(0).to(tl.int64)
    pos = k * BLOCK + tl.arange(0, BLOCK)
    first = tl.load(firsts_ptr + k)
    last = tl.minimum(tl.load(firsts_ptr + k + 1) + 1, num_bags)  # past the block's last bag
    steps = tl.ceil(tl.log2((last - first + 1).to(tl.float32))).to(tl.int32)
    lo = tl.zeros([BLOCK], dtype=tl.int64) + first
    bag = _bag_search(offsets_ptr, pos, lo, lo - first + last, steps)
    tl.store(bag_ptr + pos, bag, mask=pos < nnz)


def search(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    bags = offsets.numel() - 1
    bag = torch.empty(nnz, dtype=torch.int32, device=offsets.device)
    _search_kernel[(triton.cdiv(nnz, BLOCK),)](offsets, bag, nnz, bags, bags.bit_length(), BLOCK=BLOCK)
    return bag


def scatter(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    bags = offsets.numel() - 1
    bag = torch.empty(nnz, dtype=torch.int32, device=offsets.device)
    _scatter_kernel[(triton.cdiv(bags, 256),)](offsets, bag, bags, BLOCK_B=256, BLOCK_L=4)
    return bag


def two_levels(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    bags, blocks = offsets.numel() - 1, triton.cdiv(nnz, BLOCK)
    firsts = torch.empty(blocks + 1, dtype=torch.int64, device=offsets.device)
    _firsts_kernel[(triton.cdiv(blocks + 1, 128),)](
        offsets, firsts, blocks, bags, bags.bit_length(), BLOCK=BLOCK, LANES=128
    )
    bag = torch.empty(nnz, dtype=torch.int32, device=offsets.device)
    _within_kernel[(blocks,)](offsets, firsts, bag, nnz, bags, BLOCK=BLOCK)
    return bag


def _cases(device: torch.device):
    problem = get_problem("embedding_bags_update")
    for shape in problem.timing_shapes:
        offsets = problem.make_inputs(shape, 1, device).args[7]
        yield f"{shape.name} {shape.dtype}", offsets
    nnz, bags = 2_000_000, 1_310_720
    one = torch.zeros(bags + 1, dtype=torch.int64, device=device)
    one[bags // 2 + 1 :] = nnz
    yield f"one bag of {nnz:,} ids among {bags:,}", one
    yield f"{nnz:,} bags of one id", torch.arange(nnz + 1, device=device)


def main() -> None:
    device = torch.device("cuda")
    for name, offsets in _cases(device):
        nnz = int(offsets[-1])
        want = numbering.bags_of(offsets, nnz)
        print(f"\n{name}: {nnz:,} ids, {offsets.numel() - 1:,} bags", flush=True)
        ways = (
            ("default", numbering.bags_of),
            ("search", search),
            ("scatter 4 a step", scatter),
            ("two levels", two_levels),
        )
        for label, fn in ways:
            got = fn(offsets, nnz)
            if not torch.equal(got, want):
                raise SystemExit(f"{label} differs from the default at {name}")
            us = benchmark(fn, [((offsets, nnz), {})], device=device).median_us
            print(f"  {label:20} {us:9.1f} us", flush=True)


if __name__ == "__main__":
    main()
