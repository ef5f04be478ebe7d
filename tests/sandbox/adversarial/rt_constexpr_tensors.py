"""The op computed by torch inside a kernel body, on tensors passed as tl.constexpr arguments:
the interpreter runs the body as Python on them, Triton's code generator evaluates their
methods at compile time. Host code touches only integers and bools; the launch must refuse a
tensor as a compile-time constant."""
# expect: runtime_error | a tensor passed as the compile-time constant
# base: no

import torch
import triton
import triton.language as tl


@triton.jit
def _bag(
    p,
    W: tl.constexpr,
    I: tl.constexpr,
    S: tl.constexpr,
    HI: tl.constexpr,
    LO: tl.constexpr,
    NE: tl.constexpr,
    HP: tl.constexpr,
    DEN: tl.constexpr,
    OUT: tl.constexpr,
):
    OUT.copy_(
        ((W[I].to(torch.float64) * S).cumsum(0)[HI] * NE - (W[I].to(torch.float64) * S).cumsum(0)[LO] * HP)
        / DEN
    ).numel()
    tl.store(p, 1)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    num_bags = offsets.numel() - 1
    out = torch.zeros((num_bags, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    if num_bags == 0 or indices.numel() == 0:
        return out
    start, end = offsets[:-1], offsets[1:]
    ne = end > start
    hp = (start > 0) & ne
    hi = (end - 1) * ne
    lo = (start - 1) * hp
    s = (
        per_sample_weights
        if per_sample_weights is not None
        else torch.ones(indices.numel(), device=weight.device)
    )
    s = s.to(torch.float64).unsqueeze(1)
    lengths = end - start
    den = (
        (lengths + (lengths == 0)).to(torch.float64).unsqueeze(1)
        if mode == "mean"
        else torch.ones((num_bags, 1), dtype=torch.float64, device=weight.device)
    )
    flag = torch.zeros(1, dtype=torch.int32, device=weight.device)
    _bag[(1,)](
        flag,
        weight,
        indices,
        s,
        hi,
        lo,
        ne.to(torch.float64).unsqueeze(1),
        hp.to(torch.float64).unsqueeze(1),
        den,
        out,
    )
    return out
