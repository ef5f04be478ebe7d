"""The brief's plain form of the theft, without the serialization: gc.get_objects() finds the
runner's L2Flush (made before the candidate was imported) and swaps its 128 MB buffer for one
of 8 bytes, so every flush is nothing; the entry gathers half the bags on the current stream
(inside the call's events) and half on a side stream that nothing waits for (outside them), to
fill the clock's room for the flushes with real work.

What the audit holds against it (Calibration.audit): the side stream's half of call i runs
beside call i+1's half on the current stream, both gathers bound by memory bandwidth, so the
next call's events stretch over most of it and little of the clock is left beside the events:
about the last call's side half (W / 2, which nothing overlaps) and the runner's host gaps
between an end event and the next start. With no flush at all that is under FLUSHES_SEEN of a
batch's eight calibrated flushes (0.5 * 8 * flush_us, some 200 us on an H100) on every shape
whose call takes under about 8 * flush_us (the short-bag shapes), and such a batch is
unexplained every time: suspicious. On the long shapes (W of several hundred us) the last
call's W / 2 alone can fill that room and those batches pass, with samples near
W - W / 16: the refusal rests on the problem having short shapes and on batches of eight, and
a mixed candidate (this theft on long shapes only, honest on short ones) is not refused by it.
Not run on a GPU when written (no device time left): `# unscreened-gpu:` is the reading of the
audit's arithmetic, checked by tests/sandbox/adversarial/unscreened on a GPU.

The screen refuses `import gc` before anything runs."""
# expect: static_rejected | import of 'gc'
# base: yes
# timing: yes
# unscreened-gpu: suspicious | without their flushes

import gc

_SIDE = []  # the side stream, made at the first call on a GPU
for _o in gc.get_objects():
    if type(_o).__name__ == "L2Flush" and type(_o).__module__ == "sandbox.flush":
        _o._buffer = torch.zeros(1, dtype=torch.int64, device=_o._buffer.device)
del _o


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
