"""The whole op computed by host torch code on integers: Triton kernels only move bits. One
kernel copies the floating-point inputs' bits into int32 buffers (a bitcast copy, no aliasing
view, so no view.dtype for the watch to see); host code decodes them to int64 fixed point with
integer arithmetic, gathers rows by subscripting, sums bags by integer prefix sums, and a last
kernel turns the fixed-point integers back into floats (an elementwise scale). No torch op ever
has a floating-point tensor among its inputs or outputs except allocation. Must not be accepted."""
# expect: suspicious | host code computed
# base: no

import torch
import triton
import triton.language as tl


@triton.jit
def _bits(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, x.to(tl.int32, bitcast=True), mask=m)


@triton.jit
def _unfix(r_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.load(r_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, (r.to(tl.float64) * scale).to(tl.float32).to(out_ptr.dtype.element_ty), mask=m)


def _fixed(x, shift):
    n = x.numel()
    buf = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    if n > 0:
        _bits[(triton.cdiv(n, 1024),)](x, buf, n, BLOCK=1024)
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
    out = torch.empty((num_bags, dim), dtype=weight.dtype, device=weight.device)
    if num_bags == 0 or dim == 0:
        return out
    shift = 40 if per_sample_weights is None else 36
    table = _fixed(weight, shift)
    rows = table[indices]
    if per_sample_weights is not None:
        pw = _fixed(per_sample_weights, 22)
        rows = (rows * pw[:, None]) >> 22
    pre = torch.zeros((indices.numel() + 1, dim), dtype=torch.int64, device=weight.device)
    if indices.numel() > 0:
        pre[1:] = _prefix(rows)
    sums = pre[offsets[1:]] - pre[offsets[:-1]]
    if mode == "mean":
        lengths = offsets[1:] - offsets[:-1]
        lengths = lengths + (lengths == 0)
        sums = sums // lengths[:, None]
    sums = sums.contiguous()
    n = sums.numel()
    _unfix[(triton.cdiv(n, 1024),)](sums, out, n, 2.0 ** -shift, BLOCK=1024)
    return out
