"""The L2 flush before each timed call, shared by the sandbox's judge and runner and every
benchmark (sandbox.timing), so that a call is timed from the same cache state wherever its
number is reported. Imports torch alone: the runner imports it before any candidate code."""

from __future__ import annotations

import torch

# Twice the H200's 60 MB L2: reading it evicts everything a previous call left there.
L2_FLUSH_BYTES = 128 * 1024 * 1024

# Taken at import, before any candidate code runs in the runner's process: a torch.sum patched
# later cannot turn the flush into nothing.
_sum = torch.sum


class L2Flush:
    """Empties the L2 cache before a timed call by reading a buffer twice its size (one sum):
    what an earlier call left there is evicted (its dirty lines written back now, untimed), and
    what replaces it is clean. A flush that writes the buffer (zero_()) leaves the L2 full of
    dirty lines instead, which the timed call then writes back to HBM in its own time: up to
    the L2's 50 to 60 MB, some 17 us at an H100's bandwidth, as much as a small call's own
    traffic. The judge and the runner flush with this one, and so does every benchmark."""

    def __init__(self, device: torch.device | str, nbytes: int = L2_FLUSH_BYTES) -> None:
        self._buffer = torch.ones(nbytes // 8, dtype=torch.int64, device=device)
        self._sink = torch.empty((), dtype=torch.int64, device=device)

    def __call__(self) -> None:
        _sum(self._buffer, dim=0, out=self._sink)
