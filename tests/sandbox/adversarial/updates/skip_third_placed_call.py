"""Tells timed calls from checked ones by the writable region's layout: on a CPU a view's
storage_offset() is its offset in the shared region, so a call whose `weights` lie further in
than one call's updated arguments and two of the largest gaps was placed third or later, which
only a timed batch's calls are (a check places one call, trial 0 two, an interpreted warm-up
two); such a call returns at once. Must fail: timed calls are checked too (in the interpreter,
every one)."""
# from: template
# expect: wrong | timed call
# timing: yes
# cpu-only: yes (on a GPU every view is a storage of its own: storage_offset() is 0)

EDITS = [
    (
        "    nnz = indices.numel()\n    if nnz == 0:\n        return\n",
        "    nnz = indices.numel()\n    if nnz == 0:\n        return\n"
        "    one = -(-weights.numel() * weights.element_size() // 256) * 256\n"
        "    one += -(-state.numel() * state.element_size() // 256) * 256\n"
        "    if weights.storage_offset() * weights.element_size() >= one + 2 * 16 * 256:\n"
        "        return\n",
    ),
]
