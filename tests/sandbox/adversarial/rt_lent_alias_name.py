"""Reads the interpreter's lent `interpreter_semantic` in a kernel without binding it: the screen's
names rule skips any name that some import aliases (check_name returns for `name in aliases`), and
an import inside a function that never runs makes `interpreter_semantic` an alias while the
module's global stays unbound, so at the first rewrite the interpreter lends the real
TritonSemantic and the kernel reads it (and `_InterpreterComparison` the same way). Its attributes
the screen admits (load, store, atomic_*, cast ...) reach only the bounded builder today, so this
is a gap in the names rule, not an escape by itself; any future lent or injected global would be
readable the same way.
Held: the screen refuses an import alias named in interpreter_memory.REWRITE_NAMES (rule names)."""
# expect: static_rejected | interpreter_semantic
# expect-gpu: static_rejected | interpreter_semantic
# base: yes


def _never():
    from triton.language import float32 as interpreter_semantic


@triton.jit
def _reads_lent(p):
    tl.store(p, interpreter_semantic.cast(tl.load(p), tl.int64) + 1)


_probe = torch.zeros(1, dtype=torch.int64)
_reads_lent[(1,)](_probe)
print("RT-LENT the kernel read interpreter_semantic:", _probe.item())


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
