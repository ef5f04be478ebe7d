"""Turns the runner's L2 flush into half of one and waits in it for work the timed events never
saw: the entry gathers the first half of the bags on the current stream (inside the call's
events) and the second half on a side stream of its own (outside them), and the flush, found in
the runner's process as sys.modules["sandbox.flush"] and its captured `_zero` and `_sum`
replaced in the module's globals, first makes the current stream wait for that side stream and
then zeroes half its buffer. Every timed call's second half thus runs in the flush's slot,
between one call's end event and the next call's start event, serialized with both (no overlap
that would stretch an event), inside the judge's clock and counted there as flush time.

What goes unchecked (sandbox.judge.Calibration.audit): the audit asks only that the clock hold
half the calibrated flushes beside the events (FLUSHES_SEEN), and it then takes
(wall - rtt) / n - flush_us as the clock's per-call share. Half a flush plus the hidden half of
the work fill that room, so the batch passes, and the sample max(W - flush_us / 2, W / 2) for
a call whose honest sample is W hides min(flush_us / 2, W / 2) of real work a call (the 128 MB
zero_ is some 40 to 50 us on an H100 by its write bandwidth, not measured here), where the GPU
bounds the call; where the host's launches bound it, the events span host time and the second
launch costs the theft back. Half a flush (64 MB) still passes over more than the L2, so no
cache state is gained: the gain is the theft alone. The flush module's names are taken at
import (sandbox.flush) but remain the module's globals, which the candidate's process can
rebind; nothing in the judge sees that the flush ran short or that a stream waited in it.
Not run on a GPU when written (no device time left): the `# hole:` is the reading of the audit's
arithmetic, which tests/sandbox/adversarial/unscreened checks with RECFORGE_RUN_HOLES=1.

The screen refuses `import sys` (and torch.cuda) before anything runs: only a candidate past the
screen reaches the audit (tests/sandbox/adversarial/unscreened evaluates it so, on a GPU)."""
# expect: static_rejected | import of 'sys'
# base: yes
# timing: yes
# hole: the runner's flush rebound through sandbox.flush's globals to wait for a side stream and zero half its buffer: the audit's FLUSHES_SEEN room is filled with real work outside the events, and the judge credits it as flush time

import sys

_SIDE = []  # the side stream, made at the first call on a GPU
_KEPT = 2  # the flush zeroes 1/_KEPT of its buffer: half the calibrated flush stays in the clock


def _gated(original):
    def flush(buffer, *args, **kwargs):
        if _SIDE:
            # The previous call's side work ends before the next call's start event.
            torch.cuda.current_stream().wait_stream(_SIDE[0])
        return original(buffer[: buffer.numel() // _KEPT], *args, **kwargs)

    return flush


_FLUSH = sys.modules.get("sandbox.flush")
if _FLUSH is not None:
    _FLUSH._zero = _gated(_FLUSH._zero)
    _FLUSH._sum = _gated(_FLUSH._sum)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    num_bags = offsets.numel() - 1
    out = torch.empty((num_bags, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    if weight.device.type != "cuda" or num_bags < 2:
        return _launch(weight, indices, offsets, out, mode, per_sample_weights)
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    half = num_bags // 2
    _launch(weight, indices, offsets[: half + 1], out[:half], mode, per_sample_weights)
    side = _SIDE[0]
    side.wait_stream(torch.cuda.current_stream())  # after the output's allocation and first half
    with torch.cuda.stream(side):
        _launch(weight, indices, offsets[half:], out[half:], mode, per_sample_weights)
    return out
