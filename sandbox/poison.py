"""NaN bytes in the memory a call's allocations will get: an output element a kernel never
writes then reads as NaN, not as whatever an earlier call left there (a correct value, where the
element does not depend on the inputs: the untouched rows of a dense gradient, a padding).

On CUDA the caching allocator hands a request the smallest free block it holds that fits, from
one of two pools: blocks of up to 1 MiB come from 2 MiB segments of their own. A single large
block, filled and freed, is what a large request next gets, but never a small one, nor a block
that a candidate keeps from being merged with its neighbours. So every free block of the
allocator is filled, each by taking it whole (a request of its exact size, largest first: each
then takes that block; a small segment's free space in pieces of at most 1 MiB, pass after
pass until nothing is left free) and giving it back; a large block reserved first (and freed)
leaves room of its own for the calls, poisoned with the rest. On a CPU (interpreted Triton) one
block filled and freed.
"""

from __future__ import annotations

import contextlib

import torch

POISON_BYTE = 0xFF  # all-ones is NaN in fp16, bf16, fp32 and fp64
# The CUDA allocator's small pool serves requests of at most this many bytes, from 2 MiB segments:
# a free block of a small segment larger than this is taken in pieces.
SMALL_BYTES = 1 << 20
MAX_PASSES = 8
# The functions the poison calls, taken when the runner imports this module, before any candidate
# is loaded: rebinding these names of torch afterwards does not reach the poison. (What they call
# in turn, and tensor methods such as fill_, are still looked up when called: the screen's rule
# against assigning attributes is what guards those.)
_empty, _device = torch.empty, torch.device
_current_device, _current_stream = torch.cuda.current_device, torch.cuda.current_stream
_memory_snapshot, _mem_get_info = torch.cuda.memory_snapshot, torch.cuda.mem_get_info
_memory_reserved, _OutOfMemory = torch.cuda.memory_reserved, torch.cuda.OutOfMemoryError
_memory_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)


def poison(device: torch.device | str, nbytes: int) -> int:
    """Fill the memory the next allocations on `device` can get with POISON_BYTE, having reserved
    room of `nbytes` where there is none cached and the device and the process's cap hold it
    (a reserve that ran out of memory would have the allocator release its cached blocks, whose
    pages the next allocations then get unfilled). Returns the bytes filled."""
    device = _device(device)
    if device.type != "cuda":
        if nbytes <= 0:
            return 0
        block = _empty(nbytes, dtype=torch.uint8, device=device)
        block.fill_(POISON_BYTE)
        return nbytes
    if device.index is None:  # the allocator's and the driver's queries want an index
        device = _device("cuda", _current_device())
    free = _free_blocks(device)
    largest = max((size for size, small in free if not small), default=0)
    if nbytes > 0 and largest < nbytes <= _room(device):
        reserve = _empty(nbytes, dtype=torch.uint8, device=device)
        del reserve
        free = _free_blocks(device)
    held = []
    with contextlib.suppress(_OutOfMemory):  # not expected: every request is cached
        for _ in range(MAX_PASSES):
            if not free:
                break
            # Largest first, each whole, a small segment's in pieces of at most SMALL_BYTES (a
            # larger request goes to the large pool): a piece's remainder is the next pass's.
            sizes = sorted((min(size, SMALL_BYTES) if small else size for size, small in free), reverse=True)
            held.extend(_empty(size, dtype=torch.uint8, device=device) for size in sizes)
            free = _free_blocks(device)
    for block in held:
        block.fill_(POISON_BYTE)
    filled = sum(block.numel() for block in held)
    del held
    return filled


def _free_blocks(device: torch.device) -> list[tuple[int, bool]]:
    """(size, in the small pool) of each block the allocator holds free for this stream's requests
    on `device`."""
    stream = _current_stream(device).cuda_stream
    return [
        (block["size"], segment["segment_type"] == "small")
        for segment in _memory_snapshot()
        if segment["device"] == device.index and segment["stream"] == stream
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]


def _room(device: torch.device) -> int:
    """Bytes a new segment may take: the device's free memory and the process's cap on what the
    allocator reserves, less a margin for the segment's rounding."""
    free, total = _mem_get_info(device)
    fraction = _memory_fraction(device)
    capped = int(fraction * total) - _memory_reserved(device)
    return min(free, capped) - (64 << 20)
