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
        "        BLOCK_D=triton.next_power_of_2(max_dim),\n        num_warps=4,\n    )\n",
        "        BLOCK_D=triton.next_power_of_2(max_dim),\n        num_warps=4,\n    )\n"
        "    target.copy_(weights)\n",
    ),
]
