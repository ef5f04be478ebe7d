"""Reads names at import before the module binds them: the screen's names rule takes a name
bound by an unconditional module-level statement as defined everywhere, but the candidate
launches its kernel before the statements `np = 0` and `_interpreter = 0` run. Triton's
interpreter rewrites the kernel at that first launch and copies its own module's globals into
the candidate's where the names are still missing (FunctionRewriter._compile_and_exec), so the
kernel body reads numpy and the interpreter's C extension, whose raw `load` / `store` (attribute
names the screen admits in a kernel) bypass the InterpreterBuilder methods that
interpreter_memory bounds: any host address, given as a compile-time int, is read and written,
and from the runner's objects (as in rt_interp_raw_address) the builtins' exec runs code in the
runner. Refusing `del` alone (rt_calls_deleted_global) does not close this.
Held: the runner's interpreter lends a rewritten kernel only the names its transform writes
(sandbox/interpreter_memory.py, REWRITE_NAMES), so the kernel's first read of `_interpreter` fails
at the import's launch; compiled, the name is not defined either."""
# expect: compile_error | name '_interpreter' is not defined
# expect-gpu: compile_error | _interpreter
# base: yes


@triton.jit
def _raw_copy(dummy_ptr, SRC: tl.constexpr, DST: tl.constexpr):
    _interpreter.store(
        np.reshape(DST, (1,)).view(np.dtype("uint64")),
        _interpreter.load(
            np.reshape(SRC, (1,)).view(np.dtype("uint64")),
            np.reshape(True, (1,)),
            np.reshape(0, (1,)),
            np.dtype("int64"),
        ),
        np.reshape(True, (1,)),
    )


_cell = torch.zeros(1, dtype=torch.int64)
_dummy = torch.zeros(1, dtype=torch.int64)


def _rd(addr):
    _raw_copy[(1,)](_dummy, addr, _cell.data_ptr())
    return _cell.tolist()[0]


def _wr(addr, val):
    _cell.fill_(val)
    _raw_copy[(1,)](_dummy, _cell.data_ptr(), addr)


def _box(x=None):
    return x


def _where(f):
    return int(repr(f).split(" at ")[1].strip(">"), 16)  # no id(): a function's repr shows it


_dict = _rd(_where(_rd) + 24)  # PyFunctionObject.func_builtins (3.11): the builtins dict
_defaults = _rd(_where(_box) + 56)  # PyFunctionObject.func_defaults: the tuple (None,)
_wr(_dict, _rd(_dict) + 1)  # a reference for the tuple slot
_wr(_defaults + 24, _dict)  # PyTupleObject.ob_item[0]
_run = _box().get("exec")
_run("import os; print('RT-CALLS exec in the runner, uid', os.getuid())", {})

# Bound only now, after the rewrite copied the interpreter's values in: "defined" for the screen.
np = 0
_interpreter = 0


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
