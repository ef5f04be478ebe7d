"""The L2 flush before each timed call (sandbox.flush)."""

from __future__ import annotations

import pytest
import torch

from sandbox.flush import L2Flush


@pytest.mark.parametrize("reads", [True, False])
def test_the_flush_passes_over_its_whole_buffer_with_the_torch_it_imported(monkeypatch, reads: bool) -> None:
    """Each flush reads every element of its buffer (a sum, nothing else written) or writes
    every one (zeros), with torch's functions taken when the runner imported the module: a
    later torch.sum or Tensor.zero_ replaced does not turn the flush into nothing. (Best effort
    in the candidate's process: the judge's audit also holds each batch's clock to room for its
    flushes, sandbox.judge.Calibration.audit.)"""
    flush = L2Flush("cpu", reads=reads, nbytes=8 * 1000)
    flush._sink.fill_(0)
    flush._buffer.fill_(1)
    monkeypatch.setattr(torch, "sum", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.Tensor, "zero_", lambda self: self)
    flush()
    if reads:
        assert int(flush._sink) == 1000 and bool((flush._buffer == 1).all())
    else:
        assert not bool(flush._buffer.any())
