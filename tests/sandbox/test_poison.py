"""The poison (sandbox/poison.py): whatever block the next allocation gets holds NaN bytes."""

from __future__ import annotations

import pytest
import torch

from sandbox.poison import POISON_BYTE, poison

# Sizes of both of the CUDA allocator's pools: up to 1 MiB (2 MiB segments of their own), and over.
SIZES = (512, 4096, 300_000, 1 << 20, 3 << 20, 40 << 20)


@pytest.mark.gpu
def test_every_block_the_allocator_holds_free_reads_as_poison() -> None:
    """Blocks of both pools freed between blocks still held (so none merges with a neighbour,
    as a candidate's kept buffer would shield its freed output), each holding earlier data: after
    the poison, a request of each size gets NaN bytes, a small one too (never reached by one
    large poisoned block)."""
    device = torch.device("cuda")
    kept, freed = [], []
    for size in SIZES:
        for _ in range(3):
            freed.append(torch.full((size,), 0x11, dtype=torch.uint8, device=device))
            kept.append(torch.full((size,), 0x22, dtype=torch.uint8, device=device))
    del freed
    torch.cuda.synchronize()
    assert poison(device, 0) > 0
    # Every block taken before any is read: a comparison's own result would be freed into the
    # small pool and handed to the next request.
    again = {size: [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(3)] for size in SIZES}
    for size, blocks in again.items():
        for block in blocks:
            assert bool((block == POISON_BYTE).all()), f"a block of {size} bytes kept earlier data"
    assert all(bool((k == 0x22).all()) for k in kept)  # what is held is never touched


@pytest.mark.gpu
def test_a_small_block_alone_in_its_segment_reads_as_poison() -> None:
    """A small block freed alone leaves its 2 MiB segment one free block, larger than any request
    the small pool serves: filled in pieces, the next small request still gets NaN bytes."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()  # (the test's own: no candidate can call it)
    block = torch.full((4096,), 0x11, dtype=torch.uint8, device=device)
    del block
    torch.cuda.synchronize()
    poison(device, 0)
    assert bool((torch.empty(4096, dtype=torch.uint8, device=device) == POISON_BYTE).all())


@pytest.mark.gpu
def test_a_reserve_the_device_cannot_hold_is_skipped() -> None:
    """The poison never runs a call out of memory: a reserve larger than the device is skipped,
    and the free blocks are filled all the same."""
    device = torch.device("cuda")
    block = torch.full((1 << 20,), 0x11, dtype=torch.uint8, device=device)
    del block
    total = torch.cuda.get_device_properties(device).total_memory
    assert poison(device, 4 * total) >= 1 << 20
    assert bool((torch.empty(1 << 20, dtype=torch.uint8, device=device) == POISON_BYTE).all())


def test_on_a_cpu_one_block_is_filled() -> None:
    assert poison("cpu", 4096) == 4096
    assert poison("cpu", 0) == 0
