"""Reaches triton.language.core (the language's implementation module, with its builtins and
the semantic layer) through an alias of the language."""
# expect: static_rejected | triton.language.core
# base: yes

from triton import language as lang


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    return lang.core.builtin
