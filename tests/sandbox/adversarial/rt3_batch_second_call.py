"""Tells checks from timed calls by where their inputs lie. Packed back to back, a batch's calls
(timed, or the warm-up) began where the previous call's inputs ended, and a lone check or no-op
proof always lay at the start of its region, the lowest address the candidate had seen: so it
computes only calls whose table lies at that lowest address and skips the rest (garbage out),
which once went unchecked in about 61% of interpreted evaluations (one batch of 3 timed calls,
one of them checked). Calls now go to the region in a random order after random gaps, checks
too, and every interpreted timed call is checked: the skipped checks make it wrong."""
# expect: wrong | outside
# base: yes
# timing: yes

_LOWEST = [0]  # the lowest table address seen: where the old layout put every lone check


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    if _LOWEST[0] == 0 or weight.data_ptr() < _LOWEST[0]:
        _LOWEST[0] = weight.data_ptr()
    if weight.data_ptr() != _LOWEST[0]:
        return out  # "a batch's later call": skipped
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
