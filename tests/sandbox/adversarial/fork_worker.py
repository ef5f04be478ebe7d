"""Forks a child that outlives the evaluation (and could keep the GPU busy for the next one)."""
# expect: static_rejected | 'os'
# base: yes

import os


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    if os.fork() == 0:
        while True:
            pass
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
