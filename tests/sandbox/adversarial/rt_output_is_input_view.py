"""Returns a view of the (shared) weight table, shaped like the output: memory the judge owns
must never be accepted as an output."""
# expect: wrong | shares memory with an input
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    bags = offsets.numel() - 1
    out = torch.empty((bags, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _launch(weight, indices, offsets, out, mode, per_sample_weights)
    if 0 < bags <= weight.shape[0]:
        return weight.narrow(0, 0, bags)
    return out
