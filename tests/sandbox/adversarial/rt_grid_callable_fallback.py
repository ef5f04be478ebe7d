"""The op computed by host torch ops inside the launch's grid callable, which Triton calls
inside the launch; with launches disabled the grid is never evaluated and the output stays
zero, so the no-op proof alone would pass it: the host-compute watch must cover launches."""
# expect: suspicious | host code computed on floating-point tensors
# base: no

import torch
import triton
import triton.language as tl


@triton.jit
def _noop(p):
    pass


def _host(weight, indices, offsets, mode, psw, out):
    lengths = offsets[1:] - offsets[:-1]
    lmax = max(lengths.tolist()) if lengths.numel() else 0
    acc = torch.zeros((out.shape[0], weight.shape[1]), dtype=torch.float32, device=weight.device)
    for step in range(lmax):
        pos = offsets[:-1] + step
        live = pos < offsets[1:]
        pos = pos * live
        rows = weight[indices[pos]].float() * live[:, None].float()
        if psw is not None:
            rows = rows * psw[pos].float()[:, None]
        acc = acc + rows
    if mode == "mean":
        acc = acc / (lengths + (lengths == 0)).float()[:, None]
    out.copy_(acc)
    return (1,)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.zeros((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    if out.shape[0] == 0 or indices.numel() == 0:
        return out
    _noop[lambda meta: _host(weight, indices, offsets, mode, per_sample_weights, out)](out)
    return out
