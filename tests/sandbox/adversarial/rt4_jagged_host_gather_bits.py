"""jagged_to_padded_dense (a data-movement problem, host copies of floats count as compute)
done by host torch code on integers: one Triton kernel copies the values' bits (and the padding
value's) into an int32 buffer by bitcast, host code builds every output row's source index and
gathers the bits by subscripting an int32 tensor, and a second kernel bitcasts the gathered bits
back. The kernels are elementwise bit copies that know nothing of the op. Must not be accepted."""
# expect: suspicious | host code computed
# base: no
# problem: jagged_to_padded_dense

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _bits(x_ptr, out_ptr, n, pad, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, x.to(tl.int32, bitcast=True), mask=m)
    if tl.program_id(0) == 0:
        p = tl.full([BLOCK], pad, tl.float32).to(tl.int32, bitcast=True)
        tl.store(out_ptr + n + tl.arange(0, BLOCK), p, mask=tl.arange(0, BLOCK) < 1)


@triton.jit
def _unbits(b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    b = tl.load(b_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, b.to(tl.float32, bitcast=True).to(out_ptr.dtype.element_ty), mask=m)


def _rounded(value, dtype):
    bits = {torch.bfloat16: 8, torch.float16: 11}.get(dtype)
    if bits is None or value == 0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * 2**bits), exponent - bits)


def jagged_to_padded_dense(values, offsets, *, max_len, padding_value=0.0):
    total, dim = values.shape
    num = offsets.shape[0] - 1
    out = torch.empty((num, max_len, dim), dtype=values.dtype, device=values.device)
    if out.numel() == 0:
        return out
    n = total * dim
    flat = torch.empty((n + 1,), dtype=torch.int32, device=values.device)
    _bits[(max(1, triton.cdiv(n, 1024)),)](values, flat, n, _rounded(float(padding_value), values.dtype), BLOCK=1024)
    # row `total` of the table is the padding value, broadcast over the row
    table = torch.empty((total + 1, dim), dtype=torch.int32, device=values.device)
    table[:total] = flat[:n].view(total, dim)
    table[total] = flat[n]
    off = offsets.to(torch.int64)
    lengths = off[1:] - off[:-1]
    pos = torch.arange(max_len, device=values.device)[None, :]
    keep = (pos < lengths[:, None]).to(torch.int64)
    src = (off[:-1, None] + pos) * keep + total * (1 - keep)
    gathered = table[src].contiguous()
    m = gathered.numel()
    _unbits[(triton.cdiv(m, 1024),)](gathered, out, m, BLOCK=1024)
    return out
