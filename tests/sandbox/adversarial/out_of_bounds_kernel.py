"""Reads far outside its tensors from inside a kernel: an illegal address on a GPU (which
poisons the CUDA context), a bad pointer in the interpreter. The worker dies or raises; either
way the evaluation is recorded and the next worker starts clean."""
# expect: runtime_error |
# base: yes


@triton.jit
def _wild(x_ptr, out_ptr):
    tl.store(out_ptr, tl.load(x_ptr + (1 << 40)))


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    _wild[(1,)](weight, out)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
