"""Within the screen's allowlist: the op computed by host code, a gather by subscripting the
table with the indices, the bags summed by the builtin sum over slices; a one-element flag
kernel tells the no-op proof (every launch disabled) apart, where it returns zeros as a kernel
that did not run would. No static screen of Python tells these tensors from numbers: the
host-compute watch must see the gather on floating-point data."""
# expect: suspicious | host code computed on floating-point tensors
# base: no

import torch
import triton
import triton.language as tl


@triton.jit
def _flag(p):
    tl.store(p, 1)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    flag = torch.zeros(1, dtype=torch.int32, device=weight.device)
    _flag[(1,)](flag)
    num_bags = offsets.numel() - 1
    if flag.item() != 1:
        return torch.zeros((num_bags, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    rows = weight[indices].float()
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.float()[:, None]
    bounds = offsets.tolist()
    out = torch.zeros((num_bags, weight.shape[1]), dtype=torch.float32, device=weight.device)
    for b in range(num_bags):
        s, e = bounds[b], bounds[b + 1]
        if e > s:
            out[b] = sum(rows[s:e]) / ((e - s) if mode == "mean" else 1)
    return out.to(weight.dtype)
