"""Computes the op with torch ops the screen does not name, and launches a kernel on the side
so that a kernel is seen to run."""
# expect: suspicious | every Triton kernel disabled
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    num_bags = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    bag_ids = torch.arange(num_bags, device=weight.device).repeat(1, 1)
    which = (torch.arange(indices.numel(), device=weight.device)[:, None] >= offsets[None, 1:]).sum(1)
    rows = weight[indices].float()
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.float()[:, None]
    out = torch.zeros((num_bags, weight.shape[1]), device=weight.device)
    out.index_put_((which,), rows, accumulate=True)
    if mode == "mean":
        out = out / lengths.clamp(min=1)[:, None]
    _launch(weight, indices, offsets, torch.empty_like(out, dtype=weight.dtype), mode, per_sample_weights)
    del bag_ids
    return out.to(weight.dtype)
