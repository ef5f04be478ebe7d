"""Writes a file outside its scratch directory (to persist state for a later candidate)."""
# expect: static_rejected | open()
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    with open("/tmp/recforge-adversarial-marker", "w") as f:
        f.write("was here")
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
