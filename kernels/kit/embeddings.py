"""The kit's numbering of sorted embedding ids: what the fused training update of table-batched
embeddings (kernels/embedding_bags_update.py) and any candidate of it build their per-row work on,
on the device and without a host sync.

Every id gets its bag, the ids are sorted by their row's key (a row's index in the row-wise
state, unique across tables: row_offsets[feature] + id) so that a row's ids lie together, and
the sorted ids are cut into chunks, a new one at each row's first id and at every multiple of
`chunk` positions: a chunk holds at most `chunk` ids of one row, and a row of more (a hot id)
spans several.

    bag, sorted_keys, order, starts, count = number_chunks(row_offsets, indices, offsets, batch,
                                                           chunk, int32_keys=True)

or in steps, for a kernel that numbers the chunks while it resolves each sorted position:

    bag, sorted_keys, order = sort_by_row(row_offsets, indices, offsets, batch, int32_keys=True)
    before, count = count_chunks(sorted_keys, chunk)
    # then, in a kernel of CHUNK_BLOCK positions a program:
    #     pos, valid, key, row_start, new, chunk_of = chunk_numbers(keys_ptr, before_ptr, ...)

Also the embedding kernels' register caps (register_cap), which hold for one Triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "CHUNK_BLOCK",
    "bags_of",
    "chunk_numbers",
    "count_chunks",
    "number_chunks",
    "register_cap",
    "sort_by_row",
]

# Sorted positions a program of the chunk numbering takes (count_chunks; chunk_numbers' BLOCK).
CHUNK_BLOCK = 1024

# The Triton the embedding kernels' register caps were measured under (an H100, BENCHMARKS.md,
# 2026-12-07): another version allocates otherwise (3.9 takes 168 registers a thread for the
# pooled lookup tile where 3.6 takes 126, and 70 or more for the update's rows kernel where 3.6
# takes 53), so the same cap would spill there.
CAPS_MEASURED_UNDER = "3.6."


def register_cap(registers: int) -> int | None:
    """A launch's maxnreg: `registers` under the Triton the cap was measured with, else None (no
    cap). Candidates read it here: their screen refuses version attributes."""
    return registers if triton.__version__.startswith(CAPS_MEASURED_UNDER) else None


@triton.jit
def chunk_numbers(keys_ptr, before_ptr, block, nnz, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Block `block` of BLOCK (= CHUNK_BLOCK) sorted positions: pos, valid (pos < nnz), their
    keys, row_start (the row's first id), new (a chunk's first: a row's first id, or a multiple
    of CHUNK), and chunk_of, the chunk that each new position starts (after count_chunks, whose
    before[block] counts the chunks of earlier blocks; before_ptr None: not computed, 0)."""
    pos = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = pos < nnz
    key = tl.load(keys_ptr + pos, mask=valid, other=0)
    prior = tl.load(keys_ptr + pos - 1, mask=valid & (pos > 0), other=0)
    row_start = valid & ((pos == 0) | (key != prior))
    new = row_start | (valid & (pos % CHUNK == 0))
    chunk_of = tl.cumsum(new.to(tl.int32), axis=0) - 1
    if before_ptr is not None:
        chunk_of = tl.load(before_ptr + block) + chunk_of
    return pos, valid, key, row_start, new, chunk_of


@triton.jit
def _chunks_kernel(
    keys_ptr, before_ptr, starts_ptr, nnz, COUNT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr
):
    """The chunks that start in block k of BLOCK sorted positions: COUNT, how many, into
    before[k]; else starts[c] = the first position of chunk c (after _scan_kernel)."""
    if COUNT:
        _, _, _, _, new, _ = chunk_numbers(keys_ptr, None, tl.program_id(0), nnz, CHUNK, BLOCK)
        tl.store(before_ptr + tl.program_id(0), tl.sum(new.to(tl.int64), axis=0))
    else:
        pos, _, _, _, new, chunk_of = chunk_numbers(keys_ptr, before_ptr, tl.program_id(0), nnz, CHUNK, BLOCK)
        tl.store(starts_ptr + chunk_of, pos, mask=new)


@triton.jit
def _scan_kernel(counts_ptr, total_ptr, n, BLOCK: tl.constexpr):
    """One program: counts[:n] become their exclusive prefix sums, in place; *total, their sum."""
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for first in range(0, n, BLOCK):
        at = first + tl.arange(0, BLOCK)
        counts = tl.load(counts_ptr + at, mask=at < n, other=0)
        tl.store(counts_ptr + at, total + tl.cumsum(counts, axis=0) - counts, mask=at < n)
        total += tl.sum(counts, axis=0)
    tl.store(total_ptr, total)


@triton.jit
def _bag_starts_kernel(offsets_ptr, bag_ptr, nnz, num_bags, BLOCK: tl.constexpr):
    """bag[p] = b at the first id p of every bag b that holds any (no other bag starts there);
    never past nnz, whatever the offsets (the update's op does not read them to check)."""
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    start = tl.load(offsets_ptr + b, mask=b < num_bags, other=0)
    end = tl.load(offsets_ptr + b + 1, mask=b < num_bags, other=0)
    live = (b < num_bags) & (start < end) & (start >= 0) & (start < nnz)
    tl.store(bag_ptr + start, b.to(bag_ptr.dtype.element_ty), mask=live)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _bags_kernel(offsets_ptr, bag_ptr, nnz, num_bags, steps, BLOCK: tl.constexpr):
    """bag[p], in place of _bag_starts_kernel's marks (-1 elsewhere): the last bag that starts at
    or before p, the running maximum of the block's marks, or, before its first, the bag of the
    block's first id, found by a search over all bags' ends (how many end at or before it)."""
    first = tl.program_id(0).to(tl.int64) * BLOCK
    pos = first + tl.arange(0, BLOCK)
    marks = tl.load(bag_ptr + pos, mask=pos < nnz, other=-1)
    lo, hi = first * 0, first * 0 + num_bags
    for _ in range(steps):
        mid = (lo + hi) // 2
        past = (lo < hi) & (tl.load(offsets_ptr + mid + 1, mask=lo < hi, other=0) <= first)
        lo, hi = tl.where(past, mid + 1, lo), tl.where(past, hi, mid)
    bag = tl.maximum(tl.associative_scan(marks, 0, _larger), lo.to(marks.dtype))
    tl.store(bag_ptr + pos, bag, mask=pos < nnz)


def bags_of(offsets: torch.Tensor, nnz: int, *, kernels: bool | None = None) -> torch.Tensor:
    """Every one of nnz > 0 ids' bag (int32 below 2^31 bags), for offsets that run from 0 to nnz
    and never decrease: each bag that holds ids marks its first, then a running maximum. Its
    work is the ids' and bags' number whatever the bags' lengths (evals/studies/update_bags.py:
    a search per id took up to 2x the time; a scatter by bags, a block's longest bag; a count
    of the bags' ends by atomic adds, 0.9 ms with many empty bags at one place).

    `kernels` None: those kernels on a GPU, and on a CPU a search over the bags' ends (the call's
    offsets) by torch, which gives the same bags: Triton's interpreter runs the running maximum
    (an associative scan of a function of its own) one id at a time in Python, half of the
    update's time at its check shapes. True or False: the kernels, or the search, anywhere."""
    bags = offsets.numel() - 1
    dtype = torch.int32 if bags < 2**31 else torch.int64
    if kernels is None:
        kernels = offsets.device.type != "cpu"
    if not kernels:
        positions = torch.arange(nnz, dtype=offsets.dtype, device=offsets.device)
        ends = offsets[1:].contiguous()
        return torch.searchsorted(ends, positions, right=True, out_int32=dtype == torch.int32)
    bag = torch.full((nnz,), -1, dtype=dtype, device=offsets.device)
    _bag_starts_kernel[(triton.cdiv(bags, 1024),)](offsets, bag, nnz, bags, BLOCK=1024)
    _bags_kernel[(triton.cdiv(nnz, 2048),)](offsets, bag, nnz, bags, bags.bit_length(), BLOCK=2048)
    return bag


def sort_by_row(
    row_offsets: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, batch: int, *, int32_keys: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nnz > 0 ids' bags (int32 below 2^31 bags), their rows' keys sorted (int32 where the rows
    allow, for a sort of half the passes), and the keys' order.

    Torch ops make the keys from the call's integer inputs and sort them before any launch: the
    sandbox's host-compute watch refuses host ops on integers a kernel may have written."""
    nnz, device = indices.numel(), indices.device
    positions = torch.arange(nnz, dtype=offsets.dtype, device=device)
    # Each id's feature: how many features end at or before it (a search over F offsets).
    feature = torch.searchsorted(offsets[batch::batch].contiguous(), positions, right=True, out_int32=True)
    dtype = torch.int32 if int32_keys else torch.int64
    sorted_keys, order = torch.sort(row_offsets.to(dtype)[feature] + indices.to(dtype), stable=True)
    return bags_of(offsets, nnz), sorted_keys, order


def count_chunks(sorted_keys: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """before [cdiv(nnz, CHUNK_BLOCK)], the chunks that start in earlier blocks of CHUNK_BLOCK
    sorted positions, and count [1], the chunks' number (read by kernels, never by the host)."""
    nnz, blocks = sorted_keys.numel(), triton.cdiv(sorted_keys.numel(), CHUNK_BLOCK)
    before = torch.empty(blocks, dtype=torch.int64, device=sorted_keys.device)
    count = torch.empty(1, dtype=torch.int64, device=sorted_keys.device)
    _chunks_kernel[(blocks,)](sorted_keys, before, before, nnz, COUNT=True, CHUNK=chunk, BLOCK=CHUNK_BLOCK)
    _scan_kernel[(1,)](before, count, blocks, BLOCK=1024)
    return before, count


def number_chunks(
    row_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    batch: int,
    chunk: int,
    *,
    int32_keys: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The numbering of nnz > 0 ids (on the device, no sync): sort_by_row's bag, sorted keys
    and order; starts [nnz + 1], where starts[c] is the first sorted position of chunk c and nnz
    follows the last; and count_chunks' count."""
    bag, sorted_keys, order = sort_by_row(row_offsets, indices, offsets, batch, int32_keys=int32_keys)
    nnz = sorted_keys.numel()
    before, count = count_chunks(sorted_keys, chunk)
    starts = torch.full((nnz + 1,), nnz, dtype=torch.int64, device=sorted_keys.device)
    _chunks_kernel[(before.numel(),)](
        sorted_keys, before, starts, nnz, COUNT=False, CHUNK=chunk, BLOCK=CHUNK_BLOCK
    )
    return bag, sorted_keys, order, starts, count
