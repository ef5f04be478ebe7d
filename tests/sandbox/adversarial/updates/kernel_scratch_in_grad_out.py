"""Uses a read-only input as scratch: the hot rows' partial sums are parked in `grad_out`'s
memory instead of a buffer of their own, as if every argument were writable now that some are.
Must not be accepted: only the arguments the op updates may be written by its kernels (on a GPU
the others are mapped read-only, and the write faults)."""
# from: template
# expect: suspicious | a kernel writing into the call's input
# expect-gpu: runtime_error |
# timing: no

EDITS = [
    (
        "    partial = torch.empty((2 * triton.cdiv(nnz, chunk), max_dim), dtype=torch.float32, device=weights.device)\n",
        "    partial = grad_out\n",
    ),
]
