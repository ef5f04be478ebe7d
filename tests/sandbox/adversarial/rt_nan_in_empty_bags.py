"""Right on every non-empty bag, NaN in the empty ones (whose reference is 0): NaN must fail
wherever the reference is finite."""
# expect: wrong | outside
# base: yes


@triton.jit
def _nan_empty(offsets_ptr, out_ptr, dim, BLOCK_D: tl.constexpr):
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    n = tl.load(offsets_ptr + bag + 1) - tl.load(offsets_ptr + bag)
    nan = tl.full([BLOCK_D], float("nan"), tl.float32)
    tl.store(
        out_ptr + bag * dim + cols,
        nan.to(out_ptr.dtype.element_ty),
        mask=(cols < dim) & ((cols * 0 + n) == 0),
    )


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _launch(weight, indices, offsets, out, mode, per_sample_weights)
    if out.shape[0] > 0:
        _nan_empty[(out.shape[0],)](
            offsets, out, weight.shape[1], BLOCK_D=triton.next_power_of_2(max(weight.shape[1], 16))
        )
    return out
