"""The output is right everywhere, but the log2-sum-exp (which the registered forward hands to
training's backward) is computed with the default scale 1/sqrt(D), ignoring `scale`: every
gradient of a model that passes a scale would be scaled by the wrong softmax normalizer. It was
accepted while the statistics were checked on a few hand-picked shapes, none with a scale; now
every check shape is checked in both forms, with scales drawn per call. Must fail.

Same kernel as rt2_control_jagged.py but for the lse_scale argument."""

# problem: jagged_attention
# entry: jagged_attention
# expect: wrong | outside tolerance
# from: rt2_control_jagged.py
EDITS = [
    (
        "    scale = q.shape[-1] ** -0.5 if scale is None else scale\n    out, lse = _forward(",
        "    scale = q.shape[-1] ** -0.5 if scale is None else scale\n    default = q.shape[-1] ** -0.5  # the defect: the statistic's scores ignore `scale`\n    out, lse = _forward(",
    ),
    (
        "        q, k, v, offsets, max_seq_len, activation, causal, num_targets, rel_bias, scale, scale, return_lse",
        "        q, k, v, offsets, max_seq_len, activation, causal, num_targets, rel_bias, scale, default, return_lse",
    ),
]
