"""The L2 flush before each timed call, shared by the sandbox's judge and runner and every
benchmark (sandbox.timing), so that a call is timed from the same cache state wherever its
number is reported. Imports torch alone: the runner imports it before any candidate code."""

from __future__ import annotations

import torch

# Twice the H200's 60 MB L2: passing over it evicts everything a previous call left there.
L2_FLUSH_BYTES = 128 * 1024 * 1024

# Whether the flush reads its buffer rather than writing it. A written flush (zero_()) leaves
# the L2 full of its own dirty lines, which the timed call then writes back to HBM in its own
# window. On an H200 (BENCHMARKS.md, 2026-12-06, thirty-first session; evals/studies/flush.py),
# calls of 23 to 76 us took 3.5 to 4.6 us less after a read flush, at every shape, with the same
# spread. The write stays the default for the judge's sake. A written flush always evicts a full
# L2 of dirty lines, whoever wrote them, so it costs the same after every call, and the judge's
# calibration of it (sandbox.judge.Calibration.measure) holds. A read flush writes back only
# what the timed call left dirty, up to the L2's, some 15 us, inside the judge's clock but
# outside the calibration. That charges a candidate its own write-back through the clock's
# share of its samples. The judge's baselines, timed by their events alone, never pay it.
READS = False

# Taken at import, before any candidate code runs in the runner's process: a torch.sum or a
# Tensor.zero_ patched later does not turn the flush into nothing. Best effort in that process
# (these names can be reached too); the judge's audit holds each batch's clock to room for its
# flushes (sandbox.judge.Calibration.audit).
_sum = torch.sum
_zero = torch.Tensor.zero_


class L2Flush:
    """Empties the L2 cache before a timed call: one pass over a buffer twice its size, a sum
    that reads it (`reads`) or a zero_() that writes it."""

    def __init__(
        self, device: torch.device | str, *, reads: bool | None = None, nbytes: int = L2_FLUSH_BYTES
    ):
        self.reads = READS if reads is None else reads
        self._buffer = torch.ones(nbytes // 8, dtype=torch.int64, device=device)
        self._sink = torch.empty((), dtype=torch.int64, device=device)

    def __call__(self) -> None:
        if self.reads:
            _sum(self._buffer, dim=0, out=self._sink)
        else:
            _zero(self._buffer)
