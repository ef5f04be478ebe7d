"""A name bound only as one function's parameter, read as a global inside a kernel: Triton's
interpreter writes `np` into the candidate's globals at its first launch, and `np.load(...,
allow_pickle=True)` of a source that is also a pickle would run any code in the runner."""
# expect: static_rejected | np is not defined
# base: yes


def _binds_np(np):
    return 0


@triton.jit
def _k(x_ptr):
    np.load("/scratch/candidate.py", allow_pickle=True)
    tl.store(x_ptr, 1)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
