"""Returns the output in float64 (the values are right): a dtype other than the reference's
must fail, even where it would compare equal."""
# expect: wrong | float64
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights).to(torch.float64)
