"""Takes the Python function behind a @triton.jit kernel (.fn) to run it on the host outside
the language's rules."""
# expect: static_rejected | .fn
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    return _bag_kernel.fn(weight, indices, offsets, weight, weight, 1, False, False, 16)
