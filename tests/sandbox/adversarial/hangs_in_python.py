"""Never returns: the hard timeout must kill the worker's whole process group."""
# expect: timeout | killed after
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    while True:
        pass
