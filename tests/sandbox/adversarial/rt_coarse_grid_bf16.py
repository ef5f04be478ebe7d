"""Exact in fp32; in bf16 rounds every element to a grid of 1/64 of the output's RMS, as a cheaper
storage format would: each element sits inside its own bound and the whole output's error norm
(about 0.0045 of its norm) inside the norm bound, but every bag under about half the typical norm
is outside its row bound, which must catch it. The grid follows the RMS so that no draw of inputs
lets the norm bound fire first."""
# expect: wrong | outside || error norm
# base: yes


@triton.jit
def _sum_squares(out_ptr, n, acc_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(out_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    tl.atomic_add(acc_ptr, tl.sum(x * x, axis=0))


@triton.jit
def _to_grid(out_ptr, n, acc_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    step = tl.sqrt(tl.load(acc_ptr) / n) / 64.0
    step = tl.maximum(step, 1e-30)
    x = tl.load(out_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    q = tl.floor(x / step + 0.5) * step
    tl.store(out_ptr + i, q.to(out_ptr.dtype.element_ty), mask=i < n)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _launch(weight, indices, offsets, out, mode, per_sample_weights)
    if weight.dtype == torch.bfloat16 and out.numel() > 0:
        acc = torch.zeros((1,), dtype=torch.float32, device=out.device)
        grid = (triton.cdiv(out.numel(), 1024),)
        _sum_squares[grid](out, out.numel(), acc, BLOCK=1024)
        _to_grid[grid](out, out.numel(), acc, BLOCK=1024)
    return out
