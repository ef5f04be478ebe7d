"""Caches results across calls: after each call a copy kernel saves the updated weights and state
in buffers the module keeps, keyed by what the call's metadata says (the tables' size, dtype and
optimizer); a later call with the same key copies the saved result into its arguments and skips
the update. Trial 0's second call (a copy of the same inputs) hits and is right. Must fail: any
other call of the shape has fresh inputs, so its saved result is another call's."""
# from: template
# expect: wrong | outside tolerance
# timing: no

EDITS = [
    (
        "@triton.jit\ndef _round(",
        "@triton.jit\ndef _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)\n"
        "    m = offs < n\n"
        "    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)\n\n\n"
        "def _copy(src, dst):\n"
        "    if dst.numel() > 0:\n"
        "        _copy_kernel[(triton.cdiv(dst.numel(), 4096),)](src, dst, dst.numel(), BLOCK=4096)\n\n\n"
        "_SAVED = {}\n\n\n"
        "@triton.jit\ndef _round(",
    ),
    (
        "def embedding_bags_update(",
        "def embedding_bags_update(weights, state, *args, optimizer=\"adagrad\", **kwargs):\n"
        "    key = (weights.numel(), state.numel(), weights.dtype, optimizer)\n"
        "    if key in _SAVED:\n"
        "        _copy(_SAVED[key][0], weights)\n"
        "        _copy(_SAVED[key][1], state)\n"
        "        return None\n"
        "    _update(weights, state, *args, optimizer=optimizer, **kwargs)\n"
        "    saved = (torch.empty_like(weights), torch.empty_like(state))\n"
        "    _copy(weights, saved[0])\n"
        "    _copy(state, saved[1])\n"
        "    _SAVED[key] = saved\n"
        "    return None\n\n\n"
        "def _update(",
    ),
]
