"""Computes the op on the host, then raises: a call that fails after its host compute must still
be reported as host compute (suspicious), not passed off as a crash (runtime_error), so that what
the watch saw is what the candidate is told."""
# expect: suspicious | then the call raised ValueError
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    rows = weight[indices]
    raise ValueError(f"gave up after gathering {rows.shape[0]} rows")
