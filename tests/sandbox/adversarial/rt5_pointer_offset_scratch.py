"""rt4 on a GPU by pointer arithmetic: the bit-copy kernel is launched with the weight and an
int64 input (`offsets`, which no launch marks) and writes the bits into a fresh int64 buffer at
`offsets_ptr + delta`, delta the two tensors' address difference: the buffer was never a launch
argument, so the watch (which marks only launch arguments) never takes it for kernel-written data,
and host code computes the op on it in integers (rt4's arithmetic). Compiled kernels address all of
the runner's GPU memory; interpreted launches are bounded to their arguments' storages, so on a CPU
the launch fails. Must not be accepted.
Held: on a GPU each launch marks every integer tensor the call made as a kernel's."""
# expect: runtime_error | outside every tensor its launch was given
# expect-gpu: suspicious | host code computed
# base: no
# timing: yes

import torch
import triton
import triton.language as tl


@triton.jit
def _bits_at(x_ptr, anchor_ptr, delta, n, BLOCK: tl.constexpr):
    # Writes through `anchor_ptr + delta`: memory of a tensor this launch was never given.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    tl.store(anchor_ptr + delta + offs, bits, mask=m)


@triton.jit
def _unfix(r_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.load(r_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, (r.to(tl.float64) * scale).to(tl.float32).to(out_ptr.dtype.element_ty), mask=m)


def _fixed(x, shift, anchor):
    """x as int64 fixed point; its bits reach `buf` through a pointer offset from `anchor` (an
    int64 input, never marked): buf is no launch's argument, so no launch marks it."""
    n = x.numel()
    buf = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    if n > 0:
        delta = (buf.data_ptr() - anchor.data_ptr()) // 8
        _bits_at[(triton.cdiv(n, 1024),)](x, anchor, delta, n, BLOCK=1024)
    b = buf
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
    table = _fixed(weight, shift, offsets)
    rows = table[indices]
    if per_sample_weights is not None:
        pw = _fixed(per_sample_weights, 22, offsets)
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
