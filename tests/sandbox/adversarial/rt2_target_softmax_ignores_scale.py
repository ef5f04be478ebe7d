"""Keyword coverage: a softmax path that ignores `scale` (always 1/sqrt(D)) gets every softmax
call with a scale (a temperature) wrong, in its output and its log2-sum-exp. It was accepted
while the only target_attention check shape with an explicit scale was a silu one; scales are
now drawn per call on every check shape that names none. Must fail.

Same kernel as rt2_control_target.py but for the softmax path's score scale."""

# problem: target_attention
# entry: target_attention
# expect: wrong | outside tolerance
# from: rt2_control_target.py
EDITS = [
    (
        "    scale = q_cand.shape[-1] ** -0.5 if scale is None else scale\n    out, lse = _forward(q_cand, k, v, kv_offsets, cand_to_request, activation, scale, return_lse)",
        '    scale = q_cand.shape[-1] ** -0.5 if scale is None else scale\n    if activation == "softmax":\n        scale = q_cand.shape[-1] ** -0.5  # the defect: softmax ignores the caller\'s scale\n    out, lse = _forward(q_cand, k, v, kv_offsets, cand_to_request, activation, scale, return_lse)',
    ),
]
