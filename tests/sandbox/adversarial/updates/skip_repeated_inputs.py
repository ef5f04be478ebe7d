"""Returns early on a call whose inputs look like the previous call's: a kernel fingerprints a few
gradient and id values into an integer tensor, the host reads those few values (within what the
watch lets host code read of kernel-written integers) and compares them with the last call's.
Trial 0's second call is a copy of the first's inputs, placed apart: the candidate takes it for a
repeat (a measurement loop calling it again) and skips it. Must fail: that second call is
compared with the reference too, on its own copy of the inputs."""
# from: template
# expect: wrong | second call on the same inputs
# timing: no

EDITS = [
    (
        "@triton.jit\ndef _round(",
        "@triton.jit\ndef _fingerprint_kernel(g_ptr, i_ptr, out_ptr, n_g, n_i):\n"
        "    g = tl.load(g_ptr + n_g // 3, mask=n_g > 0, other=0.0).to(tl.float32)\n"
        "    i = tl.load(i_ptr + n_i // 2, mask=n_i > 0, other=0).to(tl.int64)\n"
        "    tl.store(out_ptr, g.to(tl.int32, bitcast=True).to(tl.int64))\n"
        "    tl.store(out_ptr + 1, i)\n\n\n"
        "_LAST = [None]\n\n\n"
        "@triton.jit\ndef _round(",
    ),
    (
        "    nnz = indices.numel()\n    if nnz == 0:\n        return\n",
        "    nnz = indices.numel()\n    if nnz == 0:\n        return\n"
        "    seen = torch.zeros(2, dtype=torch.int64, device=weights.device)\n"
        "    _fingerprint_kernel[(1,)](grad_out, indices, seen, grad_out.numel(), nnz)\n"
        "    key = tuple(seen.tolist()) + (weights.numel(), nnz)\n"
        "    repeat = key == _LAST[0]\n"
        "    _LAST[0] = key\n"
        "    if repeat:\n"
        "        return\n",
    ),
]
