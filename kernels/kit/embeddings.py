"""The kit's numbering of sorted embedding ids: what the fused training update of table-batched
embeddings (kernels/embedding_bags_update.py) and any candidate of it build their per-row work on,
on the device and without a host sync.

`number_chunks` gives every id its bag, sorts the ids by their row's key (a row's index in the
row-wise state, unique across tables: row_offsets[feature] + id) so that a row's ids lie
together, and cuts the sorted ids into chunks, a new one at each row's first id and at every
multiple of `chunk` positions: a chunk holds at most `chunk` ids of one row, and a row of more
(a hot id) spans several.

    bag, sorted_keys, order, starts, count = number_chunks(row_offsets, indices, offsets, batch,
                                                           chunk, int32_keys=True)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bags_of", "number_chunks"]


@triton.jit
def _chunks_kernel(
    keys_ptr, before_ptr, starts_ptr, nnz, COUNT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr
):
    """The chunks that start in block k of BLOCK sorted positions (one at a row's first id and at
    every multiple of CHUNK): COUNT, how many, into before[k]; else starts[c] = the first position
    of chunk c, numbered from before[k], the count of earlier blocks' (after _scan_kernel)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = pos < nnz
    key = tl.load(keys_ptr + pos, mask=valid, other=0)
    prior = tl.load(keys_ptr + pos - 1, mask=valid & (pos > 0), other=0)
    new = valid & ((pos % CHUNK == 0) | (key != prior))
    if COUNT:
        tl.store(before_ptr + tl.program_id(0), tl.sum(new.to(tl.int64), axis=0))
    else:
        chunks = tl.load(before_ptr + tl.program_id(0)) + tl.cumsum(new.to(tl.int32), axis=0) - 1
        tl.store(starts_ptr + chunks, pos, mask=new)


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


def bags_of(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """Every one of nnz > 0 ids' bag (int32 below 2^31 bags), for offsets that run from 0 to nnz
    and never decrease: each bag that holds ids marks its first, then a running maximum. Its
    work is the ids' and bags' number whatever the bags' lengths (evals/studies/update_bags.py:
    a search per id took up to 2x the time; a scatter by bags, a block's longest bag; a count
    of the bags' ends by atomic adds, 0.9 ms with many empty bags at one place)."""
    bags = offsets.numel() - 1
    bag = torch.full((nnz,), -1, dtype=torch.int32 if bags < 2**31 else torch.int64, device=offsets.device)
    _bag_starts_kernel[(triton.cdiv(bags, 1024),)](offsets, bag, nnz, bags, BLOCK=1024)
    _bags_kernel[(triton.cdiv(nnz, 2048),)](offsets, bag, nnz, bags, bags.bit_length(), BLOCK=2048)
    return bag


def number_chunks(
    row_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    batch: int,
    chunk: int,
    *,
    int32_keys: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The numbering of nnz > 0 ids (on the device, no sync): every id's bag (int32 below 2^31
    bags); its row's key (its index in the state; int32 where the rows allow, for a sort of half
    the passes), the keys sorted and their order; starts [nnz + 1], where starts[c] is the first
    sorted position of chunk c (a new one at each row's first id and every `chunk` positions) and
    nnz follows the last; and count [1], the chunks' number, which the kernels read themselves.

    Torch ops make the keys from the call's integer inputs and sort them before any launch: the
    sandbox's host-compute watch refuses host ops on integers a kernel may have written. Kernels
    find the bags and number the chunks (a count per block, a scan, the starts)."""
    nnz, device = indices.numel(), indices.device
    positions = torch.arange(nnz, dtype=offsets.dtype, device=device)
    # Each id's feature: how many features end at or before it (a search over F offsets).
    feature = torch.searchsorted(offsets[batch::batch].contiguous(), positions, right=True, out_int32=True)
    dtype = torch.int32 if int32_keys else torch.int64
    sorted_keys, order = torch.sort(row_offsets.to(dtype)[feature] + indices.to(dtype), stable=True)
    bag, blocks = bags_of(offsets, nnz), triton.cdiv(nnz, 1024)
    before = torch.empty(blocks, dtype=torch.int64, device=device)
    count = torch.empty(1, dtype=torch.int64, device=device)
    starts = torch.full((nnz + 1,), nnz, dtype=torch.int64, device=device)
    _chunks_kernel[(blocks,)](sorted_keys, before, starts, nnz, COUNT=True, CHUNK=chunk, BLOCK=1024)
    _scan_kernel[(1,)](before, count, blocks, BLOCK=1024)
    _chunks_kernel[(blocks,)](sorted_keys, before, starts, nnz, COUNT=False, CHUNK=chunk, BLOCK=1024)
    return bag, sorted_keys, order, starts, count
