"""Write-then-restore through the call's own integer input: the watch never marks the call's own
inputs as kernel-written (host_ops.HostOps.inputs). A bit-copy kernel writes the weight table's
float bits, chunk by chunk, into the `indices` input itself; host torch code decodes them from
`indices` into int64 fixed point (ops on an input: unwatched), then copies the original indices
back. Host code then gathers rows by subscripting and sums bags by integer prefix sums (rt4's
arithmetic); a last kernel scales fixed point to floats. The kernels know nothing of the op.
Must not be accepted.
Held: the call's inputs are read-only: the kernel's write is found after its launch (on a GPU it
faults on the read-only mapping) and the host's restore is refused, so the call fails on the
indices the kernel made, and the judge is told what the watch found first. Where the judge's
random schedule puts a no-op proof first, the kernels do nothing and what the watch finds first
is the host's restore into the input."""
# expect: suspicious | a kernel writing into the call's input || host code computed on floating-point tensors with aten.copy_.default writing into the call's input
# expect-gpu: runtime_error |
# base: yes
# timing: yes


@triton.jit
def _stash(w_ptr, dst_ptr, n_w, start, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    src = start + 2 * offs
    a = tl.load(w_ptr + src, mask=m & (src < n_w), other=0.0).to(tl.float32)
    b = tl.load(w_ptr + src + 1, mask=m & (src + 1 < n_w), other=0.0).to(tl.float32)
    lo = a.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    hi = b.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    tl.store(dst_ptr + offs, lo | (hi << 32), mask=m)


@triton.jit
def _unfix(r_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.load(r_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, (r.to(tl.float64) * scale).to(tl.float32).to(out_ptr.dtype.element_ty), mask=m)


def _decode(b, shift):
    sign = b >> 31
    e = (b >> 23) & 255
    m = (b & 0x7FFFFF) + (e > 0) * 0x800000
    base = 150 - shift
    sl = (e - base) * (e >= base)
    sr = (base - e) * (e < base)
    sr = sr - (sr - 62) * (sr > 62)
    v = (m << sl) >> sr
    return v * (1 - 2 * sign)


def _fixed(x, carrier, shift):
    """x's values as int64 fixed point, read through `carrier` (an input int64 tensor)."""
    n_w = x.numel()
    cap = carrier.numel()
    flat = torch.empty(2 * cap * triton.cdiv(n_w, 2 * cap), dtype=torch.int64, device=x.device)
    for k in range(triton.cdiv(n_w, 2 * cap)):
        _stash[(triton.cdiv(cap, 1024),)](x, carrier, n_w, 2 * cap * k, cap, BLOCK=1024)
        v = carrier.view(-1)
        flat[2 * cap * k : 2 * cap * (k + 1) : 2] = _decode(v & 0xFFFFFFFF, shift)
        flat[2 * cap * k + 1 : 2 * cap * (k + 1) : 2] = _decode((v >> 32) & 0xFFFFFFFF, shift)
    return flat[:n_w].view(x.shape)


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
    if num_bags == 0 or dim == 0 or indices.numel() == 0:
        return _launch(weight, indices, offsets, out, mode, per_sample_weights)
    keep = indices.clone()
    shift = 40 if per_sample_weights is None else 36
    table = _fixed(weight, indices, shift)
    pw = None if per_sample_weights is None else _fixed(per_sample_weights, indices, 22)
    indices.copy_(keep)  # restored: the judge finds its inputs unchanged
    rows = table[keep]
    if pw is not None:
        rows = (rows * pw[:, None]) >> 22
    pre = torch.zeros((keep.numel() + 1, dim), dtype=torch.int64, device=weight.device)
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
