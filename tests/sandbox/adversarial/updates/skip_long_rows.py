"""Skips the rows the checks might not weigh: rows held by more than CHUNK ids (hot rows) are
never finished (the second launch, which sums their chunks and steps them, is left out). Hot rows
are few; in a flat buffer of mostly cold rows they might look like noise. Must fail: every
element of the flat buffer is compared."""
# from: template
# expect: wrong | outside tolerance
# timing: no

EDITS = [
    ("    _long_rows_kernel[(triton.cdiv(nnz, chunk),)](", "    _long_rows_kernel[(0,)]("),
]
