"""Ignores return_lse: always returns the output alone, as a serving-only kernel would. Training
would then need a second forward for the statistics (or crash), so the training form must be
refused: the shapes that pass return_lse expect (out, lse). Must fail, and does.

Same kernel as rt2_control_jagged.py but for the return."""

# problem: jagged_attention
# entry: jagged_attention
# expect: wrong | returned
# from: rt2_control_jagged.py
EDITS = [
    (
        "    return (out, lse) if return_lse else out",
        "    return out  # the defect: return_lse ignored",
    ),
]
