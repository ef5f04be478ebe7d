"""Asks for far more memory than the machine has (on a GPU: all of it)."""
# expect: runtime_error | memory
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    hog = torch.ones(1 << 42, dtype=torch.uint8, device=weight.device)
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights) + hog[0]
