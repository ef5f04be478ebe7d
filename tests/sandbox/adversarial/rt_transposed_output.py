"""Returns the right values through a transposed view (strides [1, B]): a layout that is not the
reference's contiguous one must be refused, not silently copied."""
# expect: wrong | strides
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _launch(weight, indices, offsets, out, mode, per_sample_weights)
    return out.t().contiguous().t()
