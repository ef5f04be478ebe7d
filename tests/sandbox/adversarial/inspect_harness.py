"""Walks up the call stack to read the harness's reference output and return it."""
# expect: static_rejected | f_back
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    frame = torch.empty(0).__class__
    caller = embedding_bag.__code__
    return caller.f_back.f_locals["ref"]
