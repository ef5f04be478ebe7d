"""A softmax training forward (return_lse=True) that reads num_targets[0] for every sequence, as
if the count were uniform, gets both its output and its log2-sum-exp wrong wherever users have
different numbers of candidates (its serving form is right). It was accepted while the training
form was checked on three shapes, all with one target count for every sequence; every check
shape is now checked in both forms. Must fail.

Same kernel as rt2_control_jagged.py but for the targets' stride in the training form."""

# problem: jagged_attention
# entry: jagged_attention
# expect: wrong | outside tolerance
# from: rt2_control_jagged.py
EDITS = [
    (
        "    H, D, DV, T, inv_max_len, qk_scale, lse_scale,",
        "    H, D, DV, T, inv_max_len, qk_scale, lse_scale, tgt_stride,",
    ),
    (
        "        n_hist = n - tl.minimum(tl.load(tgt_ptr + b).to(tl.int32), n)",
        "        n_hist = n - tl.minimum(tl.load(tgt_ptr + b * tgt_stride).to(tl.int32), n)",
    ),
    (
        "        heads, dim, dim_v, total, 1.0 / max_seq_len, scale, lse_scale,\n        SOFTMAX=softmax, CAUSAL=causal, HAS_TARGETS=num_targets is not None,",
        "        heads, dim, dim_v, total, 1.0 / max_seq_len, scale, lse_scale,\n        0 if (want_lse and softmax) else 1,  # the defect: one target count for all, in training\n        SOFTMAX=softmax, CAUSAL=causal, HAS_TARGETS=num_targets is not None,",
    ),
]
