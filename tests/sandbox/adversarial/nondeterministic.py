"""Correct on the first call of each shape, off on every later one (the judge calls twice on
the same inputs, then on fresh ones): results that depend on call history (a race, a stale
cache) must not pass."""
# expect: wrong | outside tolerance
# base: yes

_CALLS = {}


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    # By shape: the tensors of every call are new objects (views of the judge's shared memory).
    key = (tuple(weight.shape), indices.numel(), offsets.numel())
    _CALLS[key] = _CALLS.get(key, 0) + 1
    # Later calls reduce the other way (a mean for a sum): off wherever a bag has two ids or more.
    flipped = mode if _CALLS[key] == 1 else ("mean" if mode == "sum" else "sum")
    return _launch(weight, indices, offsets, out, flipped, per_sample_weights)
