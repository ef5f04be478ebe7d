"""Replaces the benchmark's timer so every measurement reads as nearly zero."""
# expect: static_rejected | do_bench
# base: yes

import triton.testing

triton.testing.do_bench = lambda *args, **kwargs: 1e-6


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
