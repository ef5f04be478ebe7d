"""rt4 by another route: a kernel writes the inputs' VALUES, scaled by 2**40, into a fresh
float64 buffer (float launch arguments are never marked as kernel-written), and host code casts
that buffer to int64 (`_to_copy`, bookkeeping on any dtype): the integers it computes on are
marked nowhere. Host code then gathers rows by subscripting, weights and sums bags by integer
prefix sums, and a last kernel scales the fixed-point sums back. Must not be accepted.
Held: integers a host cast makes from floating-point data count as a kernel's."""
# expect: suspicious | host code computed
# base: no
# timing: yes

import torch
import triton
import triton.language as tl


@triton.jit
def _scale(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float64)
    tl.store(out_ptr + offs, x * scale, mask=m)


@triton.jit
def _unfix(r_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.load(r_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, (r.to(tl.float64) * scale).to(tl.float32).to(out_ptr.dtype.element_ty), mask=m)


def _fixed(x, shift):
    """x * 2**shift, scaled by a kernel into a float64 buffer (floats are never marked as
    kernel-written), then cast to int64 by host code: _to_copy is bookkeeping."""
    n = x.numel()
    buf = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    if n > 0:
        _scale[(triton.cdiv(n, 1024),)](x, buf, n, 2.0**shift, BLOCK=1024)
    return buf.to(torch.int64)


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
    _unfix[(triton.cdiv(n, 1024),)](sums, out, n, 2.0**-shift, BLOCK=1024)
    return out
