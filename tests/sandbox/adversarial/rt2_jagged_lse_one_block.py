"""A classic online-softmax bug in the statistic alone: the log2-sum-exp's running sum is not
rescaled when a later key block raises the row maximum, so the lse is right only for rows that
fit in one key block. It was accepted on a CPU while only shapes of rows up to
100 keys asked for return_lse (the 250-key row was checked in the serving form only); every
check shape is now checked in both forms. Must fail.

Same kernel as rt2_control_jagged.py but for that rescale."""

# problem: jagged_attention
# entry: jagged_attention
# expect: wrong | outside tolerance
# from: rt2_control_jagged.py
EDITS = [
    (
        "                l_lse = l_lse * tl.exp(m_lse - m_new2) + tl.sum(tl.exp(s_lse - m_new2[:, None]), 1)",
        "                l_lse = l_lse + tl.sum(tl.exp(s_lse - m_new2[:, None]), 1)  # the defect: no rescale",
    ),
]
