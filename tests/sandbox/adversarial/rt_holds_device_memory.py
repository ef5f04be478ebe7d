"""Holds 40 GiB while it computes: on a GPU that other evaluations share, less than the device
has but far more than the runner's allocator may hold (EvalRequest.gpu_memory_bytes), so that
evaluations beside it would run out of memory instead of it; on a CPU, past the address-space cap."""
# expect: runtime_error | memory
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    hog = torch.zeros(40 * 1024**3, dtype=torch.uint8, device=weight.device)
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights) + hog[0]
