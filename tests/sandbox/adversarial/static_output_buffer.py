"""Writes every result into one long-lived buffer and returns it: later calls overwrite what
earlier callers still hold."""
# expect: wrong | shares memory with an earlier output
# base: yes

_BUFFERS = {}


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    shape = (offsets.numel() - 1, weight.shape[1])
    key = (shape, weight.dtype)
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.empty(shape, dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, _BUFFERS[key], mode, per_sample_weights)
