"""jagged_to_padded_dense, a data-movement problem (host copies, clones and fills of floating-point
data count as compute: Problem.host_copies_compute), done entirely by host code without one such
op: each kept value is read into Python by an f-string (Tensor.__format__ -> item inside the
function mode's handler; _local_scalar_dense to the dispatch mode: bookkeeping), encoded to its
IEEE bits with math.frexp, written into an integer buffer (fill_ on an integer tensor: not
floating), and the buffer is returned viewed as the float dtype (an integer-to-float view is
bookkeeping; only float-to-integer views count). A one-element flag kernel tells the no-op proof
apart. Must not be accepted."""
# expect: suspicious | host code computed on floating-point tensors
# problem: jagged_to_padded_dense
# base: no

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _flag(p):
    tl.store(p, 1)


def _bits32(x):
    if x != x:
        return 0x7FC00000
    sign = 1 if math.copysign(1.0, x) < 0 else 0
    if x in (math.inf, -math.inf):
        return (sign << 31) | (255 << 23)
    if x == 0:
        return sign << 31
    m, e = math.frexp(abs(x))  # abs(x) = m * 2**e, 0.5 <= m < 1
    if e - 1 + 127 <= 0:  # subnormal
        return (sign << 31) | int(abs(x) * 2.0**149)
    mant = round(m * 2.0**24)  # to nearest, ties to even
    if mant == 1 << 24:
        mant, e = 1 << 23, e + 1
    return (sign << 31) | ((e - 1 + 127) << 23) | (mant - (1 << 23))


def _half(v):
    return (v + 0x7FFF + ((v >> 16) & 1)) >> 16  # fp32 bits to bf16 bits, to nearest even


def _signed(v, width):
    return v - (1 << width) if v >= (1 << (width - 1)) else v


def jagged_to_padded_dense(values, offsets, *, max_len, padding_value=0.0):
    num, dim = offsets.numel() - 1, values.shape[1]
    flag = torch.zeros(1, dtype=torch.int32, device=values.device)
    _flag[(1,)](flag)
    wide = values.dtype == torch.float32
    itype = torch.int32 if wide else torch.int16
    buf = torch.empty((num, max_len, dim), dtype=itype, device=values.device)
    if flag.item() != 1:
        return buf.view(values.dtype)
    pad = _bits32(padding_value)
    pad = _signed(pad if wide else _half(pad), 32 if wide else 16)
    buf.fill_(pad)
    bounds = offsets.tolist()
    for b in range(num):
        for t in range(min(bounds[b + 1] - bounds[b], max_len)):
            row = values[bounds[b] + t]
            for j in range(dim):
                v = _bits32(float(f"{row[j]:.17g}"))
                buf[b, t, j] = _signed(v if wide else _half(v), 32 if wide else 16)
    return buf.view(values.dtype)
