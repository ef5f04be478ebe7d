"""The L2 flush before each timed call (sandbox.flush)."""

from __future__ import annotations

import torch

from sandbox.flush import L2Flush


def test_the_flush_reads_its_whole_buffer_whatever_torch_sum_became(monkeypatch) -> None:
    """Each flush sums every element of its buffer (a read of all of it, nothing written but
    the sum), with the torch.sum taken when the runner imported the module: a candidate that
    later replaces torch.sum does not turn the flush into nothing."""
    flush = L2Flush("cpu", nbytes=8 * 1000)
    flush._sink.fill_(0)
    monkeypatch.setattr(torch, "sum", lambda *args, **kwargs: None)
    flush()
    assert int(flush._sink) == 1000
    assert bool((flush._buffer == 1).all())
