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
def _bags_kernel(offsets_ptr, bag_ptr, nnz, num_bags, steps, BLOCK: tl.constexpr):
    """bag[p] = the bag of id p, by a search over all bags: the same work in every program
    whatever the bags' lengths, and neighbouring ids take mostly the same path (the same offsets
    loaded)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    tl.store(bag_ptr + pos, _bag_search(offsets_ptr, pos, lo, lo + num_bags, steps), mask=pos < nnz)


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


def bags_of(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """Every one of nnz > 0 ids' bag, by a kernel (int32 below 2^31 bags)."""
    bags = offsets.numel() - 1
    bag = torch.empty(nnz, dtype=torch.int32 if bags < 2**31 else torch.int64, device=offsets.device)
    _bags_kernel[(triton.cdiv(nnz, 1024),)](offsets, bag, nnz, bags, bags.bit_length(), BLOCK=1024)
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
