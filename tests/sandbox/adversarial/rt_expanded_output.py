"""Computes one bag and returns it broadcast to every bag (stride 0 on the bag dimension):
an expanded view must not pass for an output."""
# expect: wrong | strides
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _launch(weight, indices, offsets, out, mode, per_sample_weights)
    return out[:1].expand(out.shape[0], -1) if out.shape[0] > 1 else out
