"""Rule memory, interpreted: a kernel run by Triton's interpreter touches only the memory of the
tensors its launch passed.

Compiled, a kernel's pointers address the GPU, where the runner holds nothing but its tensors
and the judge's shared regions. Interpreted (on a CPU), a pointer is a host address, and the
interpreter reads and writes at any address it is given: a kernel doing arithmetic on a
pointer argument could read or write the runner's own objects (its functions, its socket's
state) and so run any Python in it. Here every load, store and atomic of an interpreted launch
is checked against the address ranges of that launch's tensor arguments (their whole storages,
tensor descriptors' bases included) before it runs, masked-off lanes excepted; anything else
raises.

The interpreter also lends a kernel's module its own names: where it rewrites a kernel
(FunctionRewriter._compile_and_exec) it copies every global of its module that the kernel's
module lacks into that module, numpy and its C extension among them, whose raw loads and stores
no bound checks. A candidate that leaves a name unbound when its first kernel is rewritten (bound
only after the launch, or deleted) would reach them. Here the rewrite lends only the names its
own transform writes into the kernel (REWRITE_NAMES); any other name a kernel reads is its
module's or undefined.

Installed by the runner before any candidate code exists; it fails closed where the interpreter's
shape is not the one it knows.
"""

from __future__ import annotations

import inspect
import threading

import numpy as np
import torch

# The names the interpreter's rewrite of a kernel's source writes into it (its ASTTransformer: each
# assignment through interpreter_semantic.to_tensor, each chained comparison through
# _InterpreterComparison): all a rewritten kernel may take from the interpreter's module.
REWRITE_NAMES = ("interpreter_semantic", "_InterpreterComparison")

_launch = threading.local()  # .ranges: [(start, end)] of the launch being interpreted, or None
_np_dtype = None  # the interpreter's element-type-to-numpy map, bound by install()


class OutOfBounds(RuntimeError):
    pass


def install() -> None:
    """Wrap the interpreter's launch and memory operations (once per process)."""
    from triton.runtime import interpreter as interp

    executor, builder, rewriter = interp.GridExecutor, interp.InterpreterBuilder, interp.FunctionRewriter
    needed = [(executor, "__call__"), (executor, "_init_args_hst"), (rewriter, "_compile_and_exec")] + [
        (builder, name)
        for name in ("create_masked_load", "create_masked_store", "create_atomic_cas", "create_atomic_rmw")
    ]
    missing = [f"{cls.__name__}.{name}" for cls, name in needed if not callable(cls.__dict__.get(name))]
    missing += [name for name in REWRITE_NAMES if not hasattr(interp, name)]
    if missing:
        raise RuntimeError(
            f"this Triton's interpreter has no {', '.join(missing)}: its memory cannot be bounded"
        )
    if getattr(executor.__call__, "recforge_bounded", False):
        return
    if "_compile_and_exec(" not in inspect.getsource(rewriter.rewrite_ast):
        raise RuntimeError(
            "this Triton's interpreter rewrites kernels otherwise: the names it lends cannot be bounded"
        )
    rewriter._compile_and_exec = _lending_only({name: getattr(interp, name) for name in REWRITE_NAMES})
    global _np_dtype
    _np_dtype = interp._get_np_dtype
    executor._init_args_hst = _recording_ranges(executor._init_args_hst)
    executor.__call__ = _one_launch(executor.__call__)
    builder.create_masked_load = _checked(builder.create_masked_load, pointer=0, mask=1)
    builder.create_masked_store = _checked(builder.create_masked_store, pointer=0, mask=2, values=(1,))
    builder.create_atomic_cas = _checked(builder.create_atomic_cas, pointer=0, mask=None, values=(1, 2))
    builder.create_atomic_rmw = _checked(builder.create_atomic_rmw, pointer=1, mask=3, values=(2,))


def _lending_only(lent: dict):
    """FunctionRewriter._compile_and_exec, lending the kernel's module only `lent`'s names (where
    it lacks them) in place of every global of the interpreter's module."""

    def compile_and_exec(self, transformed_ast):
        code = compile(transformed_ast, filename=self.filename, mode="exec")
        local_namespace = {**self.kwargs}
        fn_globals = self.fn.__globals__
        for name, value in lent.items():
            fn_globals.setdefault(name, value)
        exec(code, fn_globals, local_namespace)
        return local_namespace[self.fn.__name__]

    return compile_and_exec


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "base") and isinstance(getattr(value, "base", None), torch.Tensor):
        yield value.base  # a tensor descriptor


def _recording_ranges(init_args):
    def wrapper(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _launch.ranges = [_storage_range(t) for t in _tensors([*args_hst, *kwargs_hst.values()])]
        return args_hst, kwargs_hst

    return wrapper


def _one_launch(call):
    def wrapper(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        finally:
            _launch.ranges = None

    wrapper.recforge_bounded = True
    return wrapper


def _checked(op, *, pointer: int, mask: int | None, values: tuple[int, ...] = ()):
    """`op`(self, *handles) with the pointer handle at position `pointer` (and the mask handle at
    `mask`) checked: every active lane's element lies inside one of the launch's ranges. An element
    is as wide as the widest of the pointer's element type and the value handles at `values`: the
    interpreter's C extension moves each value at its own width (Triton casts a store's value to
    the pointer's type, but not an atomic_cas's compare and value, nor a descriptor scatter's)."""

    def wrapper(self, *args, **kwargs):
        ptrs = args[pointer]
        active = None if mask is None or args[mask] is None else np.asarray(args[mask].data, dtype=bool)
        widths = [np.asarray(args[i].data).dtype.itemsize for i in values]
        _check(ptrs, active, max([_element_bytes(ptrs), *widths]))
        return op(self, *args, **kwargs)

    return wrapper


def _check(ptrs, active, width: int) -> None:
    ranges = getattr(_launch, "ranges", None)
    if ranges is None:
        raise OutOfBounds("a memory access outside any interpreted launch")
    addresses = np.asarray(ptrs.data).astype(np.uint64, copy=False)
    if active is not None:
        addresses = addresses[np.broadcast_to(active, addresses.shape)]
    else:
        addresses = addresses.reshape(-1)
    if addresses.size == 0:
        return
    itemsize = np.uint64(width)
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in ranges:
        inside |= (addresses >= np.uint64(start)) & (addresses + itemsize <= np.uint64(end))
    if not inside.all():
        bad = int(addresses[~inside][0])
        raise OutOfBounds(f"a kernel accessed address {bad:#x}, outside every tensor its launch was given")


def _element_bytes(ptrs) -> int:
    return np.dtype(_np_dtype(ptrs.get_element_ty())).itemsize
