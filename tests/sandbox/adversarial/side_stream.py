"""Launches the real work on a side stream that a timer on the default stream never waits for."""
# expect: static_rejected | Stream
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _launch(weight, indices, offsets, out, mode, per_sample_weights)
    return out
