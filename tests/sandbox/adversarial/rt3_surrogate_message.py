"""Raises an exception whose message holds a lone surrogate, written as an ASCII escape ("\ud800"):
the source is valid UTF-8, the runner's JSON channel escapes it, the judge decodes it back into a
str that no UTF-8 encoder takes, puts it in its result's message, and then cannot serialize the
result (pydantic: surrogates not allowed): the judge dies without writing a result instead of
reporting the candidate's runtime error. Must get runtime_error with the candidate's message."""
# expect: runtime_error | ValueError
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    raise ValueError("bad \ud800 value")
