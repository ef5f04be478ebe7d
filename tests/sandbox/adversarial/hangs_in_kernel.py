"""A kernel whose loop never ends: the timeout must stop work stuck inside a launch."""
# expect: timeout | killed after
# base: yes


@triton.jit
def _spin(x_ptr, n):
    i = 0
    while i >= 0:
        i = (i + tl.load(x_ptr)) % n
    tl.store(x_ptr, i)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    flag = torch.ones(1, dtype=torch.int32, device=weight.device)
    _spin[(1,)](flag, 1000)
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
