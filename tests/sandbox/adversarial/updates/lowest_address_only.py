"""Tells lone calls from several placed together by where the updated arguments lie: it updates
only when `weights` lies at the lowest address it has seen in the writable region (where a lone
check would start if calls were packed from the region's start) and returns at once otherwise
(a batch's later call, or a twin). Must fail: placements are shuffled with random gaps, and
every call is compared."""
# from: template
# expect: wrong | outside tolerance
# timing: no

EDITS = [
    (
        "@triton.jit\ndef _round(",
        "_LOWEST = [0]\n\n\n@triton.jit\ndef _round(",
    ),
    (
        "    nnz = indices.numel()\n    if nnz == 0:\n        return\n",
        "    nnz = indices.numel()\n    if nnz == 0:\n        return\n"
        "    if _LOWEST[0] == 0 or weights.data_ptr() < _LOWEST[0]:\n"
        "        _LOWEST[0] = weights.data_ptr()\n"
        "    if weights.data_ptr() != _LOWEST[0]:\n"
        "        return\n",
    ),
]
