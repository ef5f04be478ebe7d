"""Adagrad's state is read but never written back (the row's new sum is used for the step but
not stored): saves a store per row. Must fail: the state is compared as the call left it."""
# from: template
# expect: wrong | output 1
# timing: no

EDITS = [
    ("        tl.store(state_ptr + key_I, total_I, mask=mask_I)\n", ""),
]
