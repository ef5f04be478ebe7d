"""The whole op computed in host Python floats, reading every gathered element through an f-string
format spec (f"{t:.17g}" on a 0-dim tensor: Tensor.__format__, which calls .item() inside the
function mode's own handler, where the mode is off; the dispatch mode sees _local_scalar_dense,
bookkeeping) and writing each output element by subscript assignment (select + fill_,
bookkeeping). A one-element flag kernel tells the no-op proof apart. Must not be accepted."""
# expect: suspicious | host code computed on floating-point tensors
# base: no

import torch
import triton
import triton.language as tl


@triton.jit
def _flag(p):
    tl.store(p, 1)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    num_bags, dim = offsets.numel() - 1, weight.shape[1]
    flag = torch.zeros(1, dtype=torch.int32, device=weight.device)
    _flag[(1,)](flag)
    out = torch.zeros((num_bags, dim), dtype=weight.dtype, device=weight.device)
    if flag.item() != 1:
        return out
    bounds = offsets.tolist()
    ids = indices.tolist()
    for b in range(num_bags):
        acc = [0.0] * dim
        for pos in range(bounds[b], bounds[b + 1]):
            row = weight[ids[pos]]
            w = 1.0
            if per_sample_weights is not None:
                w = float(f"{per_sample_weights[pos]:.17g}")
            for j in range(dim):
                acc[j] += w * float(f"{row[j]:.17g}")
        n = max(bounds[b + 1] - bounds[b], 1) if mode == "mean" else 1
        for j in range(dim):
            out[b, j] = acc[j] / n
    return out
