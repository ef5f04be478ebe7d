"""The same theft as rt6_flush_globals_side_stream through a torch function mode left active:
entered at import and never left, it sits under the runner's own watch modes (which push and pop
above it) and sees every torch call of the runner's process, the flush's too. sandbox.flush took
torch.Tensor.zero_ and torch.sum at import, before any candidate code, but a function taken
early still dispatches through the modes active when it is called: on the flush's 128 MB int64
buffer the mode makes the current stream wait for the candidate's side stream and zeroes (or
sums) half the buffer instead. The entry gathers half the bags on the current stream (inside
the call's events) and half on the side stream (outside them), which the next flush waits for.

What goes unchecked: as for rt6_flush_globals_side_stream, the audit (Calibration.audit) takes
any time beside the events, up to the calibrated flushes, for flushes (FLUSHES_SEEN asks for
half of them); the side stream's half of the work fills the room half a flush leaves, so a call
is credited min(flush_us / 2, W / 2) of real work it did (where the GPU, not the host, bounds
the call: the mode's Python on every torch call of the runner adds host time inside the events).
Capturing the flush's functions at import does not stop a mode; nothing checks the function
mode stack between calls (the watch pushes and pops its own modes above it). Not run on a GPU
when written: the `# hole:` is the reading of the audit's arithmetic, checked by
tests/sandbox/adversarial/unscreened with RECFORGE_RUN_HOLES=1.

The screen refuses the import of torch.overrides and any name of torch.cuda: only a candidate
past the screen reaches the audit (tests/sandbox/adversarial/unscreened evaluates it so)."""
# expect: static_rejected | import from 'torch.overrides'
# base: yes
# timing: yes
# hole: a torch function mode left active from import turns the flush's captured Tensor.zero_ into a wait for a side stream and half a zero_: the FLUSHES_SEEN room is filled with real work outside the events, credited as flush time

from torch.overrides import TorchFunctionMode

_SIDE = []  # the side stream, made at the first call on a GPU
_FLUSH_NUMEL = 128 * 1024 * 1024 // 8  # sandbox.flush.L2_FLUSH_BYTES of int64


class _HalfFlush(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("zero_", "sum") and args and isinstance(args[0], torch.Tensor):
            buffer = args[0]
            if buffer.dtype == torch.int64 and buffer.numel() == _FLUSH_NUMEL and buffer.is_cuda:
                if _SIDE:
                    torch.cuda.current_stream().wait_stream(_SIDE[0])
                func(buffer[: _FLUSH_NUMEL // 2], *args[1:], **kwargs)
                return buffer
        return func(*args, **kwargs)


_HalfFlush().__enter__()  # never left


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
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _launch(weight, indices, offsets[half:], out[half:], mode, per_sample_weights)
    return out
