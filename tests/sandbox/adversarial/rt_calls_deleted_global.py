"""Deletes module-level names at import (`_interpreter = 0` then `del _interpreter`; likewise
`np`), so that they count as bound for the screen's names rule but are absent from the module's
globals when Triton's interpreter rewrites its first @triton.jit function: the rewriter then
copies its own module's globals into the candidate's (FunctionRewriter._compile_and_exec), and
the kernel body reads the interpreter's C extension (`_interpreter.load` / `.store`, attribute
names the screen admits in a kernel as tensor-descriptor methods) and numpy. Those raw loads and
stores bypass the InterpreterBuilder methods that interpreter_memory bounds, so a kernel reads
and writes any host address it is given as a compile-time int: the runner's own objects, from
which (as in rt_interp_raw_address) the builtins' exec runs code in the runner.
Held: the screen refuses deleting a module-level name (rule names); past it, the runner's
interpreter lends a kernel none of those names (rt_calls_late_binding)."""
# expect: static_rejected | deletes _interpreter, a module-level name
# expect-gpu: static_rejected | deletes _interpreter, a module-level name
# base: yes

_interpreter = 0
np = 0
del _interpreter
del np


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


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
