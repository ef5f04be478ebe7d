"""Smuggles the torch module into a lambda's default argument, then reaches torch.ops
through the parameter name (which the chain rule would not resolve)."""
# expect: static_rejected | torch is a module, used as a value
# base: yes

_ops = lambda t=torch: t.ops  # noqa: E731


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    return _ops().aten.embedding_bag(weight, indices, offsets)
