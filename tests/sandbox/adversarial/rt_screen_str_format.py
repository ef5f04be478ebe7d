"""Reads attributes by name through a format field ("{0.__class__}"), str.format being the one
string method that does."""
# expect: static_rejected | format
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    return "{0.__class__.__mro__}".format(weight)
