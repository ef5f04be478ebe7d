"""Kernels compute the new weights into a scratch copy; host code then copies them into
`weights` (copy_, a bookkeeping op the watch allows on floats). Must not be accepted: host code
never writes the call's inputs, those the op updates included (only its kernels may)."""
# from: template
# expect: suspicious | writing into the call's input
# timing: no

EDITS = [
    (
        "    nnz = indices.numel()\n    if nnz == 0:\n        return\n",
        "    nnz = indices.numel()\n    if nnz == 0:\n        return\n"
        "    target = weights\n"
        "    weights = weights.clone()\n",
    ),
    (
        "        num_warps=4,\n    )  # fmt: skip\n",
        "        num_warps=4,\n    )  # fmt: skip\n"
        "    target.copy_(weights)\n",
    ),
]
