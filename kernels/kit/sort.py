"""The kit's radix sort: non-negative integer keys of a known width sorted stably on the device,
with their order, in as few passes as the width needs (torch.sort's takes every bit of the
dtype, and an int64 order).

    sorted_keys, order = sort_pairs(keys, bits)    # order: int32 below 2^31 keys

Each pass sorts by one digit of DIGIT_BITS bits or fewer (the width split evenly), least
significant first, in three launches:

1. _digits_kernel, a program a block of BLOCK keys: each digit's count in the block, into
   counts[digit, block];
2. _counts_scan_kernel, a program a digit: its counts become their exclusive prefix sums over
   the blocks, its total into totals[digit];
3. _scatter_kernel, a program a block: the block's keys sorted by (digit, position) on chip,
   each key then stored at its digit's start (the totals of smaller digits), plus its digit's
   count in earlier blocks, plus its rank among the block's keys of that digit. The block's
   order kept within a digit makes each pass stable, and so the sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sort_pairs"]

# A pass's widest digit (its counts: 2^bits a block), the keys a program counts and places, and
# whether it ranks them by a sort on chip; interpreted, by counts (the interpreter's sort is slow).
CONFIG = {"DIGIT_BITS": 8, "BLOCK": 2048, "BY_SORT": True}
INTERPRETED = {"DIGIT_BITS": 4, "BLOCK": 256, "BY_SORT": False}


@triton.jit
def _digits(keys_ptr, block, n, shift, width, RADIX: tl.constexpr, BLOCK: tl.constexpr):
    """Block `block`'s positions, keys and digits (`width` bits from bit `shift`, below RADIX);
    RADIX past the last key (sorted last)."""
    at = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + at, mask=at < n, other=0)
    digit = tl.where(at < n, ((key >> shift) & ((1 << width) - 1)).to(tl.int32), RADIX)
    return at, key, digit


@triton.jit
def _digits_kernel(keys_ptr, counts_ptr, n, blocks, shift, width, RADIX: tl.constexpr, BLOCK: tl.constexpr):
    """counts[d * blocks + k]: how many keys of block k have digit d."""
    k = tl.program_id(0)
    at, _, digit = _digits(keys_ptr, k, n, shift, width, RADIX, BLOCK)
    counts = tl.histogram(digit, RADIX, mask=at < n)
    tl.store(counts_ptr + tl.arange(0, RADIX).to(tl.int64) * blocks + k, counts)


@triton.jit
def _counts_scan_kernel(counts_ptr, totals_ptr, blocks, BLOCK: tl.constexpr):
    """Program d: counts[d, :] become their exclusive prefix sums; totals[d], their sum."""
    row = counts_ptr + tl.program_id(0).to(tl.int64) * blocks
    total = tl.sum(tl.zeros([BLOCK], dtype=counts_ptr.dtype.element_ty), axis=0)
    for first in range(0, blocks, BLOCK):
        at = first + tl.arange(0, BLOCK)
        counts = tl.load(row + at, mask=at < blocks, other=0)
        tl.store(row + at, total + tl.cumsum(counts, axis=0) - counts, mask=at < blocks)
        total += tl.sum(counts, axis=0)
    tl.store(totals_ptr + tl.program_id(0), total)


@triton.jit
def _scatter_kernel(
    keys_ptr, values_ptr, out_keys_ptr, out_values_ptr, counts_ptr, totals_ptr, n, blocks, shift, width,
    FIRST: tl.constexpr, BY_SORT: tl.constexpr, RADIX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Block k's keys and values (FIRST: none, a key's value is its position) stored at their
    places in the pass's order (see the module's docstring). A key's rank among the block's keys
    of its digit: BY_SORT, from the block sorted by (digit, position) on chip; else counted,
    RADIX counts a key (for few digits, and the interpreter, whose sort is slow)."""
    k = tl.program_id(0)
    at, key, digit = _digits(keys_ptr, k, n, shift, width, RADIX, BLOCK)
    totals = tl.load(totals_ptr + tl.arange(0, RADIX))
    start = tl.cumsum(totals, axis=0) - totals  # where each digit's keys start
    if BY_SORT:
        counts = tl.histogram(digit, RADIX, mask=at < n)
        # The block in (digit, position) order: the i-th holds position taken % BLOCK.
        taken = tl.sort(digit * BLOCK + tl.arange(0, BLOCK))
        digit = taken // BLOCK
        at = k.to(tl.int64) * BLOCK + taken % BLOCK
        key = tl.load(keys_ptr + at, mask=digit < RADIX, other=0)
        start -= tl.cumsum(counts, axis=0) - counts  # less the digit's first place in the block
        rank = tl.arange(0, BLOCK)
    else:
        same = digit[:, None] == tl.arange(0, RADIX)[None, :]
        rank = tl.sum(tl.where(same, tl.cumsum(same.to(tl.int32), axis=0) - 1, 0), axis=1)
    live = digit < RADIX
    digit = tl.minimum(digit, RADIX - 1)
    earlier = tl.load(counts_ptr + digit.to(tl.int64) * blocks + k, mask=live, other=0)
    place = tl.gather(start, digit, 0) + earlier + rank
    tl.store(out_keys_ptr + place, key, mask=live)
    value = at.to(out_values_ptr.dtype.element_ty) if FIRST else tl.load(values_ptr + at, mask=live, other=0)
    tl.store(out_values_ptr + place, value, mask=live)


def sort_pairs(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [n] (int32 or int64, each in [0, 2^bits); others sort by their low bits alone)
    sorted stably, and order [n], sorted_keys = keys[order] (int32 below 2^31 keys)."""
    n, device = keys.numel(), keys.device
    if not 0 < bits <= 8 * keys.element_size():
        raise ValueError(f"sort_pairs: bits {bits} is not in [1, {8 * keys.element_size()}] for {keys.dtype}")
    order_dtype = torch.int32 if n < 2**31 else torch.int64
    if n == 0:
        return keys.clone(), torch.empty(0, dtype=order_dtype, device=device)
    cfg = INTERPRETED if keys.device.type == "cpu" else CONFIG
    passes = triton.cdiv(bits, cfg["DIGIT_BITS"])
    width = triton.cdiv(bits, passes)  # a pass's digit: the bits split evenly
    # The counts of every digit the widest could hold, whatever the width: one specialization.
    radix, blocks = 1 << cfg["DIGIT_BITS"], triton.cdiv(n, cfg["BLOCK"])
    counts = torch.empty(radix * blocks, dtype=order_dtype, device=device)
    totals = torch.empty(radix, dtype=order_dtype, device=device)
    keys_in, keys_out = keys.contiguous(), torch.empty_like(keys)
    values_in = values_out = torch.empty(n, dtype=order_dtype, device=device)
    for step in range(passes):
        shift = step * width
        _digits_kernel[(blocks,)](keys_in, counts, n, blocks, shift, width, RADIX=radix, BLOCK=cfg["BLOCK"])
        _counts_scan_kernel[(radix,)](counts, totals, blocks, BLOCK=1024)
        _scatter_kernel[(blocks,)](
            keys_in, values_in, keys_out, values_out, counts, totals, n, blocks, shift, width,
            FIRST=step == 0, BY_SORT=cfg["BY_SORT"], RADIX=radix, BLOCK=cfg["BLOCK"],
        )  # fmt: skip
        if step == 0:
            keys_in, keys_out = keys_out, torch.empty_like(keys)
            values_in, values_out = values_out, torch.empty(n, dtype=order_dtype, device=device)
        else:
            keys_in, keys_out = keys_out, keys_in
            values_in, values_out = values_out, values_in
    return keys_in, values_in
