"""Changes rows no bag looked up: for bf16 weights, every element of the table is first scaled
by (1 - 2^-8) (a 0.4% decay of the whole table: about one unit in the last place of most
elements), then the update runs as usual. The problem says untouched rows stay as they are; the
comparison admits 1.6e-2 of each element plus 1.6e-2 of the buffer's RMS (and 8e-3 of its norm).
Over a run, rows no batch looks up lose a unit per step.

Refused: the problem's verify holds rows no id reaches to their bits. (The decay also moves
the looked-up rows by about a unit before their step: on some draws one of them lands outside
the tolerance first, and the comparison refuses it before verify runs.)"""
# from: template
# expect: wrong | rows that no id looks up changed || outside tolerance
# timing: no

EDITS = [
    (
        "@triton.jit\ndef _round(",
        "@triton.jit\ndef _decay_kernel(w_ptr, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)\n"
        "    m = offs < n\n"
        "    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)\n"
        "    tl.store(w_ptr + offs, (w * (1.0 - 1.0 / 256.0)).to(w_ptr.dtype.element_ty), mask=m)\n\n\n"
        "@triton.jit\ndef _round(",
    ),
    (
        "    nnz = indices.numel()\n    if nnz == 0:",
        "    nnz = indices.numel()\n"
        "    if weights.dtype == torch.bfloat16 and weights.numel() > 0:\n"
        "        _decay_kernel[(triton.cdiv(weights.numel(), 4096),)](weights, weights.numel(), BLOCK=4096)\n"
        "    if nnz == 0:",
    ),
]
