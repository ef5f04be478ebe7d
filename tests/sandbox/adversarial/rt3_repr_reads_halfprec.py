"""In bf16 and fp16, the op computed in host Python floats parsed out of repr() of each gathered row:
Tensor.__repr__ is not a read to the function mode, and torch's tensor printing runs with every
dispatch mode disabled (torch._tensor_str: _disable_current_modes), so the watch sees none of the
printing's own ops on the floats either; a fix that only counts _local_scalar_dense on floats
(the f-string case) does not see this. Printing keeps 4 decimals: enough for the half-precision
tolerances, so fp32 runs the honest kernel. Each output element is written by subscript
assignment (select + fill_). A flag kernel tells the no-op proof apart. Must not be accepted."""
# expect: suspicious | host code computed on floating-point tensors
# base: yes


@triton.jit
def _flag(p):
    tl.store(p, 1)


def _row(t):
    text = repr(t)
    body = text.split("[")[1].split("]")[0]
    return [float(v.strip()) for v in body.split(",")]


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    num_bags, dim = offsets.numel() - 1, weight.shape[1]
    out = torch.zeros((num_bags, dim), dtype=weight.dtype, device=weight.device)
    if weight.dtype == torch.float32:
        return _launch(weight, indices, offsets, out, mode, per_sample_weights)
    flag = torch.zeros(1, dtype=torch.int32, device=weight.device)
    _flag[(1,)](flag)
    if flag.item() != 1:
        return out
    bounds = offsets.tolist()
    ids = indices.tolist()
    psw = None
    if per_sample_weights is not None:  # in slices: printing summarizes over 1000 elements
        psw = []
        for k in range(0, len(ids), 500):
            psw.extend(_row(per_sample_weights[k : k + 500]))
    for b in range(num_bags):
        acc = [0.0] * dim
        for pos in range(bounds[b], bounds[b + 1]):
            vals = _row(weight[ids[pos]])
            w = 1.0 if psw is None else psw[pos]
            for j in range(dim):
                acc[j] += w * vals[j]
        n = max(bounds[b + 1] - bounds[b], 1) if mode == "mean" else 1
        for j in range(dim):
            out[b, j] = acc[j] / n
    return out
