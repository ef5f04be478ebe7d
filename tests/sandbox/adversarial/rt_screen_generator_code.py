"""Reads a generator's code object (gi_code) on the way to its frame and globals."""
# expect: static_rejected | gi_code
# base: yes


def _gen():
    yield 1


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    return _gen().gi_code
