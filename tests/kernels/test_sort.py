"""The kit's radix sort (kernels/kit/sort.py) against torch's stable sort: keys and order equal,
at every width, over many blocks, with many equal keys, in both of its rankings."""

from __future__ import annotations

import pytest
import torch

import kernels.kit.sort as sort

# (keys, their bits, key dtype): widths of one pass to five, blocks whole and partial.
CASES = {
    "one-key": (1, 1, torch.int32),
    "one-pass": (300, 4, torch.int32),
    "three-passes-partial-block": (700, 12, torch.int32),
    "int32-full-width": (600, 31, torch.int32),
    "int64-wide": (500, 40, torch.int64),
    "int64-narrow": (513, 7, torch.int64),
}


def _keys(n: int, bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n * 64 + bits)
    keys = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.int64)
    keys[::3] = keys[0]  # a third of the keys equal: the order among them is the input's
    return keys.to(dtype).to(device)


def _check(keys: torch.Tensor, bits: int) -> None:
    got_keys, got_order = sort.sort_pairs(keys, bits)
    want_keys, want_order = torch.sort(keys, stable=True)
    assert got_keys.dtype == keys.dtype and got_order.dtype == torch.int32
    assert torch.equal(got_keys, want_keys)
    assert torch.equal(got_order.long(), want_order)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sort_pairs_is_torchs_stable_sort(case: str, device: torch.device) -> None:
    n, bits, dtype = CASES[case]
    _check(_keys(n, bits, dtype, device), bits)


def test_the_ranking_by_a_sort_on_chip_is_stable(monkeypatch, device: torch.device) -> None:
    """The GPU's ranking (each block sorted by digit and position), interpreted at a small block."""
    monkeypatch.setitem(sort.INTERPRETED, "BY_SORT", True)
    monkeypatch.setitem(sort.INTERPRETED, "BLOCK", 64)
    monkeypatch.setitem(sort.CONFIG, "BLOCK", 64)
    _check(_keys(150, 9, torch.int32, device), 9)


def test_no_keys_and_bad_widths(device: torch.device) -> None:
    keys, order = sort.sort_pairs(torch.empty(0, dtype=torch.int32, device=device), 8)
    assert keys.numel() == 0 and order.numel() == 0
    for bits, dtype in ((0, torch.int32), (33, torch.int32), (65, torch.int64)):
        with pytest.raises(ValueError, match=f"bits {bits} is not in"):
            sort.sort_pairs(torch.zeros(4, dtype=dtype, device=device), bits)
