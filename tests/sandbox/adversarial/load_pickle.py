"""Loads a pickle (arbitrary code at load time) dressed up as cached weights."""
# expect: static_rejected | torch.load
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    return torch.load("/tmp/answers.pt", weights_only=False)
