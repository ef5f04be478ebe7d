"""Computes the op on the host with what the screen allows (indexing, arithmetic, the builtin
sum over rows), and launches a kernel on the side so that a kernel is seen to run: the
host-compute watch sees the gather (without it, the no-op proof would catch this one)."""
# expect: suspicious | host code computed on floating-point tensors
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    rows = weight[indices].float()
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.float()[:, None]
    bounds = offsets.tolist()
    out = torch.zeros((len(bounds) - 1, weight.shape[1]), device=weight.device)
    for bag in range(len(bounds) - 1):
        start, end = bounds[bag], bounds[bag + 1]
        if end > start:
            out[bag] = sum(rows[start:end]) / ((end - start) if mode == "mean" else 1)
    _launch(weight, indices, offsets, torch.empty_like(out, dtype=weight.dtype), mode, per_sample_weights)
    return out.to(weight.dtype)
