"""Zeroes the table after use, so that a reference run afterwards on the same tensors would
also return zeros and agree with anything. The call's inputs are read-only: the write is not
made, and is reported."""
# expect: suspicious | aten.zero_.default writing into the call's input
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _launch(weight, indices, offsets, out, mode, per_sample_weights)
    weight.zero_()
    return out
