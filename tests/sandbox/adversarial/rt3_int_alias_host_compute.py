"""The whole op computed by host torch code, on integers only: the weight table's bits are read
through an int32 buffer viewed as float32 (an integer-to-float view is bookkeeping to the watch,
and so is copy_ into it), decoded to int64 fixed point, gathered by subscripting and summed per bag
with integer prefix sums; the result goes back to floating point by copying the fixed-point
integers into a float64 view of an int64 buffer and lowering the exponent field by integer
arithmetic. No torch op ever has a floating-point tensor among its inputs and outputs except
empty/view/copy_/_to_copy. A one-element flag kernel (the only kernel) tells the no-op proof
apart: there it returns zeros. Must not be accepted."""
# expect: suspicious | host code computed on floating-point tensors
# base: no

import torch
import triton
import triton.language as tl


@triton.jit
def _flag(p):
    tl.store(p, 1)


def _fixed(x, shift):
    """float tensor -> int64 fixed point at 2**shift, through an int32 buffer's float32 view."""
    buf = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    buf.view(torch.float32).copy_(x)
    b = buf.to(torch.int64) & 0xFFFFFFFF
    sign = b >> 31
    e = (b >> 23) & 255
    m = (b & 0x7FFFFF) + (e > 0) * 0x800000
    base = 150 - shift
    sl = (e - base) * (e >= base)
    sr = (base - e) * (e < base)
    sr = sr - (sr - 62) * (sr > 62)
    v = (m << sl) >> sr
    return v * (1 - 2 * sign)


def _to_float(r, shift, dtype):
    """int64 fixed point at 2**shift -> float tensor of `dtype`."""
    fb = torch.empty(r.shape, dtype=torch.int64, device=r.device)
    fb.view(torch.float64).copy_(r)
    fb = fb - (shift << 52) * (r != 0)
    return fb.view(torch.float64).to(dtype)


def _prefix(g):
    n = g.shape[0]
    p = g.clone()
    k = 1
    while k < n:
        q = p.clone()
        q[k:] += p[: n - k]
        p = q
        k *= 2
    return p


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    num_bags, dim = offsets.numel() - 1, weight.shape[1]
    flag = torch.zeros(1, dtype=torch.int32, device=weight.device)
    _flag[(1,)](flag)
    if flag.item() != 1 or num_bags == 0:
        return torch.zeros((num_bags, dim), dtype=weight.dtype, device=weight.device)
    shift = 40 if per_sample_weights is None else 36
    table = _fixed(weight, shift)
    rows = table[indices]  # [nnz, D] int64
    if per_sample_weights is not None:
        pw = _fixed(per_sample_weights, 22)
        rows = (rows * pw[:, None]) >> 22
    zero = torch.zeros((1, dim), dtype=torch.int64, device=weight.device)
    pre = torch.zeros((indices.numel() + 1, dim), dtype=torch.int64, device=weight.device)
    if indices.numel() > 0:
        pre[1:] = _prefix(rows)
    sums = pre[offsets[1:]] - pre[offsets[:-1]]
    if mode == "mean":
        lengths = offsets[1:] - offsets[:-1]
        lengths = lengths + (lengths == 0)
        sums = sums // lengths[:, None]
    del zero
    return _to_float(sums, shift, weight.dtype)
