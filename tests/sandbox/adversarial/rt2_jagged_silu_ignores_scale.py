"""Keyword coverage: a silu (HSTU pointwise) path that ignores `scale` and always uses 1/sqrt(D)
gets the output of every silu call with a scale wrong. It was accepted while the only check
shape with an explicit scale was a softmax one; scales are now drawn per call on every check
shape that names none. Must fail.

Same kernel as rt2_control_jagged.py but for the silu path's score scale."""

# problem: jagged_attention
# entry: jagged_attention
# expect: wrong | outside tolerance
# from: rt2_control_jagged.py
EDITS = [
    (
        "    scale = q.shape[-1] ** -0.5 if scale is None else scale\n    out, lse = _forward(",
        '    scale = q.shape[-1] ** -0.5 if scale is None else scale\n    if activation != "softmax":\n        scale = q.shape[-1] ** -0.5  # the defect: silu ignores the caller\'s scale\n    out, lse = _forward(',
    ),
]
