"""Rounds the table to bf16 before summing: faster reads, silently lower precision."""
# expect: wrong | outside tolerance
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    low = weight.to(torch.bfloat16).to(weight.dtype)
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(low, indices, offsets, out, mode, per_sample_weights)
