"""Hands out its outputs from a ring of nine long-lived buffers per shape: the tenth call
overwrites what the first call returned, and a caller that keeps more outputs alive (a training
step saving every layer's activations for the backward) finds earlier ones overwritten. It was
accepted while freshness was checked only against the outputs the runner still held (at most
eight); the runner now refuses any output the candidate still holds. Must fail."""
# expect: wrong | outputs must be fresh
# base: yes
# timing: yes

_RING = 9
_BUFFERS = {}
_NEXT = {}


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    shape = (offsets.numel() - 1, weight.shape[1])
    key = (shape, weight.dtype)
    if key not in _BUFFERS:
        _BUFFERS[key] = [torch.empty(shape, dtype=weight.dtype, device=weight.device) for _ in range(_RING)]
        _NEXT[key] = 0
    out = _BUFFERS[key][_NEXT[key]]
    _NEXT[key] = (_NEXT[key] + 1) % _RING
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
