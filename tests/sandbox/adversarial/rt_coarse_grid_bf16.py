"""Exact in fp32; in bf16 rounds every element to a grid of 1/64 (about the element tolerance
times the output's RMS), as a cheaper storage format would: each element may sit inside its own
bound, but the per-row norm bound must catch it."""
# expect: wrong | outside
# base: yes


@triton.jit
def _to_grid(out_ptr, n, STEP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(out_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    q = tl.floor(x / STEP + 0.5) * STEP
    tl.store(out_ptr + i, q.to(out_ptr.dtype.element_ty), mask=i < n)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _launch(weight, indices, offsets, out, mode, per_sample_weights)
    if weight.dtype == torch.bfloat16 and out.numel() > 0:
        _to_grid[(triton.cdiv(out.numel(), 1024),)](out, out.numel(), STEP=1.0 / 64, BLOCK=1024)
    return out
