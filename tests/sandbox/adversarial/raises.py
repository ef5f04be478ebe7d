"""Raises from its entry: a crash in the candidate's Python is a recorded runtime error."""
# expect: runtime_error | RuntimeError
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    raise RuntimeError("candidate gave up")
