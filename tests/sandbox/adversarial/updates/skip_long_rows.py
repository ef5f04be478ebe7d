"""Skips the rows the checks might not weigh: rows whose ids cross a tile's edge (hot rows, held
by more ids than a tile, among them) are never finished (the second launch, which sums their
tiles' parts and steps them, is left out). Such rows are few; in a flat buffer of mostly cold
rows they might look like noise. Must fail: every element of the flat buffer is compared."""
# from: template
# expect: wrong | outside tolerance
# timing: no

EDITS = [
    ("    _crossing_runs_kernel[(tiles,)](", "    _crossing_runs_kernel[(0,)]("),
]
