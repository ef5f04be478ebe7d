"""Returns zeros: passes any purely absolute tolerance on outputs of small magnitude."""
# expect: wrong | outside tolerance
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.zeros((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _launch(weight, indices, offsets, torch.empty_like(out), mode, per_sample_weights)
    return out
