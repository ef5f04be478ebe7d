"""Exact in fp32; in bf16 leaves one non-empty bag (the last) at zero, a skipped tail: a single
zeroed row must fail, however many rows are right."""
# expect: wrong | outside
# base: yes


@triton.jit
def _zero_row(out_ptr, row, dim, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    tl.store(
        out_ptr + row * dim + cols,
        tl.zeros([BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
        mask=cols < dim,
    )


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _launch(weight, indices, offsets, out, mode, per_sample_weights)
    bounds = offsets.tolist()
    nonempty = [b for b in range(len(bounds) - 1) if bounds[b + 1] > bounds[b]]
    if weight.dtype == torch.bfloat16 and nonempty:
        _zero_row[(1,)](
            out, nonempty[-1], weight.shape[1], BLOCK_D=triton.next_power_of_2(max(weight.shape[1], 16))
        )
    return out
