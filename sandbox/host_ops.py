"""The host-compute watch: which torch ops a candidate's host code runs on floating-point data.

A candidate computes its op in Triton kernels; its host code allocates, views, copies and casts
tensors and may compute on integer ones (offsets, lengths, schedules) that no kernel can have
written: integer data a kernel may have written can hold what it made of floating-point data
(its bits, its values scaled), so host ops on it, or on a copy of it, count as on floats
(HostOps says which integer data is clean). Any other torch op with a floating-point tensor
among its inputs or outputs is host code computing the op itself (a gather by indexing, a
product by an operator, a sum by a builtin), which no static screen of Python can see: tensors
and numbers look alike there; so is reading floating-point values into Python (tolist, item),
which dispatches no such op. The call's own inputs are read-only: host code never writes them
(such a write is refused and reported), and a kernel that writes them is reported (on a GPU
their memory is mapped read-only, sandbox.shared; elsewhere they are compared after each
launch). The runner
watches its calls with a torch dispatch mode and a torch function mode (every call, timed or
not: a watch that were on for some calls only could be detected from Python, and host code
could compute while it is off) and reports the first finding; only Triton's autotuning
benchmarks of compiled kernels run unwatched.

Imported by the runner before any candidate code exists.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

# Allocation, views, copies and casts: data movement a launcher needs, on any dtype.
BOOKKEEPING = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
        "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like",
        "new_full", "arange", "fill_", "zero_", "copy_", "_to_copy", "clone", "view",
        "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "expand", "t", "transpose",
        "permute", "unsqueeze", "squeeze", "select", "slice", "narrow", "split",
        "split_with_sizes", "chunk", "unbind", "alias", "detach", "lift_fresh",
        "lift_fresh_copy", "_local_scalar_dense", "contiguous", "resize_", "set_",
    }
)  # fmt: skip


# Of BOOKKEEPING, views (their output shares its input's storage) and allocations (which read
# no values of a tensor they are given, only its shape and dtype).
VIEWS = frozenset(
    {
        "view", "_unsafe_view", "_reshape_alias", "as_strided", "expand", "t", "transpose", "permute",
        "unsqueeze", "squeeze", "select", "slice", "narrow", "split", "split_with_sizes", "chunk",
        "unbind", "alias", "detach",
    }
)  # fmt: skip
ALLOCATIONS = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
        "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "arange",
        # A tensor of Python values (torch.tensor): values read into Python count where they are
        # read (READ_BUDGET), so what is made of them is clean.
        "lift_fresh", "lift_fresh_copy",
    }
)  # fmt: skip


# Of BOOKKEEPING, what moves or writes floating-point data. For a problem that is data movement
# (a jagged transform: its whole op is copies), host code doing these on floating-point data is
# doing the op itself, so they count as compute there (Problem.host_copies_compute).
DATA_MOVEMENT = frozenset(
    {
        "copy_", "_to_copy", "clone", "contiguous", "lift_fresh_copy", "fill_", "zero_", "full",
        "full_like", "new_full", "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones",
    }
)  # fmt: skip


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


# Values of kernel-written integer data a call may read into Python: a launcher reading back a
# flag or a count its kernel set is its own business; reading more is reading the data.
READ_BUDGET = 16


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """Which allocation `t` views: its storage's address and the storage object's own (two
    storages alive at once differ in both; a freed one's address alone could come back)."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage._cdata


# The watch of the call in progress, for the launch wrapper (_checked_launch) to tell what a
# kernel may have written; None outside watched calls.
_CURRENT: list[HostOps] = []


class HostOps(TorchDispatchMode):
    """Records the first torch op outside BOOKKEEPING (and `allowed`, the problem's own) that
    touches floating-point data, or integer data a kernel may have written, or floating-point
    data viewed as integers.

    Integer data is clean while no kernel can have written it: the call's own inputs (read-only
    for the call), and what host code made from clean data since the call's last launch. A
    compiled kernel can write any of the runner's GPU memory, not only its arguments (pointer
    arithmetic from one), so a launch leaves nothing else clean: not its arguments, not what the
    call made before it, not what earlier calls or the module's import made. Integers cast from
    floating-point data are not clean either (values scaled to integers are the data). Host ops
    on integer data that is not clean count as on floats; a few of its values may be read (a
    flag, a count): READ_BUDGET."""

    def __init__(
        self, allowed: frozenset[str] = frozenset(), *, copies_compute: bool = False, inputs=()
    ) -> None:
        super().__init__()
        self.allowed = (BOOKKEEPING - DATA_MOVEMENT if copies_compute else BOOKKEEPING) | allowed
        self.first: str | None = None
        self.inputs = {_storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
        # Where the inputs' bytes lie: a write is refused by address too, whatever tensor it goes
        # through (a view of an earlier call's buffer that the shared region now reuses).
        self.spans = [span for t in inputs if isinstance(t, torch.Tensor) and (span := _span(t))]
        # Integer and boolean storages made from clean data since the last launch.
        self.clean: set[tuple[int, int]] = set()
        self.values_read = 0
        # The inputs whose writes no mapping prevents, with their bits at the call's start.
        self.guarded: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.reads: HostReads | None = None
        # Inside the interpreter's own copies of a launch's arguments (to the host and back, every
        # argument, changed or not): its bookkeeping, not the candidate's host code.
        self.copying_arguments = 0

    def guard(self, tensors) -> None:
        """Keep the bits of `tensors` (inputs on writable memory) to compare after each launch."""
        with _disable_current_modes():
            self.guarded = [(t, _bits(t).clone()) for t in tensors if isinstance(t, torch.Tensor)]

    def after_launch(self) -> None:
        """A launch: nothing but the inputs stays clean, and where no mapping prevents it, the
        inputs must not have changed."""
        self.clean.clear()
        if self.first is None and self.guarded:
            with _disable_current_modes():
                for t, before in self.guarded:
                    if not torch.equal(_bits(t), before):
                        what = f"{t.dtype}, {list(t.shape)}".replace("torch.", "")
                        self.first = f"a kernel writing into the call's input ({what})"
                        break

    def _unclean(self, t) -> bool:
        """Integer or boolean data a kernel may have written (see the class docstring)."""
        if not isinstance(t, torch.Tensor) or _floating(t):
            return False
        key = _storage_key(t)
        return key not in self.clean and key not in self.inputs

    def read_unclean(self, count: int, what: str) -> None:
        """`count` values of such data read into Python: past READ_BUDGET, reading data."""
        self.values_read += count
        if self.first is None and self.values_read > READ_BUDGET:
            self.first = f"{what} ({self.values_read} values a kernel may have written, read into Python)"

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Read when the class is made (TorchDispatchMode.__init_subclass__): True would wrap
        # __torch_dispatch__ in torch._disable_dynamo, whose first call imports torch._dynamo,
        # two to three seconds of every runner's CPU time. Nothing compiles under the watch
        # (the screen admits no torch.compile), so there is no Dynamo to keep out of it.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.copying_arguments:
            return func(*args, **kwargs)  # a kernel's writes there: after_launch compares
        # Rule read-only inputs: host code never writes the call's inputs (a stash for the
        # data's bits, put back before the call returns, would otherwise pass every check). The
        # write is not made; the first such op is reported.
        target = _written_input(func, args, kwargs, self.inputs, self.spans)
        if target is not None:
            if self.first is None:
                self.first = f"{func} writing into the call's input ({target.dtype})".replace("torch.", "")
            return target
        out = func(*args, **kwargs)
        # Floating-point data viewed as integers, or integers viewed as floating-point data:
        # either way host code holds the data's bits in a tensor the rest of this watch takes
        # for integers (computing on the bits, a gather by indexing, is computing on the data;
        # a copy into a floating-point view of an integer buffer puts them there).
        as_bits = func is torch.ops.aten.view.dtype and _floating(args[0]) != _floating(out)
        if self.first is None and as_bits:
            self.first = f"{func} ({args[0].dtype} viewed as {out.dtype})".replace("torch.", "")
        # A floating-point value read into Python, however the read was spelled (item, float(),
        # a format field, printing): every read of one element comes down to this op.
        read = func is torch.ops.aten._local_scalar_dense.default and _floating(args[0])
        if self.first is None and read:
            self.first = f"{func} on {args[0].dtype} (a value read into Python)".replace("torch.", "")
        inputs = [*tree_leaves(args), *tree_leaves(kwargs)]
        unclean = [t for t in inputs if self._unclean(t)]
        name = func.overloadpacket.__name__
        # What the op made is clean where everything it read is (an allocation like a float
        # tensor reads none of its values); a view shares its base's storage, and so its state.
        if name not in VIEWS:
            reads = name not in ALLOCATIONS
            from_floats = reads and any(_floating(t) for t in inputs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not _floating(t):
                    key = _storage_key(t)
                    if (reads and unclean) or from_floats:
                        self.clean.discard(key)
                    elif key not in self.inputs:
                        self.clean.add(key)
        if self.first is None and name not in self.allowed:
            floating = [t for t in [*inputs, *tree_leaves(out)] if _floating(t)]
            if floating:
                self.first = f"{func} on {floating[0].dtype}".replace("torch.", "")
            elif unclean:
                self.first = f"{func} on {unclean[0].dtype} a kernel may have written".replace("torch.", "")
        elif unclean and func is torch.ops.aten._local_scalar_dense.default:
            self.read_unclean(1, f"{func} on {unclean[0].dtype}".replace("torch.", ""))
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as integers of its element size (NaNs compare equal to themselves so)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


_MUTATED: dict[object, tuple[tuple[int, str], ...]] = {}


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes [start, end) a tensor's elements lie in (None for an empty one)."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (extent + 1) * t.element_size()


def _written_input(func, args, kwargs, inputs: set, spans: list[tuple[int, int]]) -> torch.Tensor | None:
    """The first tensor op `func` writes that is one of the call's inputs (by storage) or lies
    on one's bytes (by address), or None."""
    mutated = _MUTATED.get(func)
    if mutated is None:
        mutated = tuple(
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _MUTATED[func] = mutated
    for i, name in mutated:
        t = args[i] if i < len(args) else kwargs.get(name)
        for leaf in tree_leaves(t):
            if not isinstance(leaf, torch.Tensor):
                continue
            if _storage_key(leaf) in inputs:
                return leaf
            written = _span(leaf)
            if written and any(written[0] < end and start < written[1] for start, end in spans):
                return leaf
    return None


def _bench_unwatched(bench):
    """The autotuner's benchmark of one config, its timing statistics unwatched (triton.testing
    computes on floats) and the launches it times watched again: the kernel's launch runs the
    candidate's own host code (a heuristics function, the grid), which is never unwatched."""

    def wrapper(self, *args, **kwargs):
        ops = _CURRENT[-1] if _CURRENT else None
        if ops is None:
            return bench(self, *args, **kwargs)
        fn, run = self.fn, self.fn.run

        def watched(*a, **k):
            with ops, ops.reads:
                return run(*a, **k)

        fn.run = watched  # the instance's, over its class's, for this benchmark only
        try:
            with _disable_current_modes():
                return bench(self, *args, **kwargs)
        finally:
            del fn.run

    wrapper.recforge_wrapped = True
    return wrapper


def _argument_copies(copy):
    """The interpreter's copies of a launch's arguments, marked as such for the watch."""

    def wrapper(*args, **kwargs):
        ops = _CURRENT[-1] if _CURRENT else None
        if ops is None:
            return copy(*args, **kwargs)
        ops.copying_arguments += 1
        try:
            return copy(*args, **kwargs)
        finally:
            ops.copying_arguments -= 1

    wrapper.recforge_wrapped = True
    return wrapper


def _untimed(self, *args, config, **meta) -> list[float]:
    """The autotuner's benchmark of one config in the interpreter: not run at all. Interpreted
    timings decide nothing, and an interpreted kernel body is host Python, which the watch
    must never be suspended for; every config ties, so the first is taken."""
    return [1.0, 1.0, 1.0]


_untimed.recforge_wrapped = True


def _constexpr_names(kernel) -> set[str]:
    params = getattr(kernel, "params", None)
    if params is not None:  # a JITFunction
        return {p.name for p in params if p.is_constexpr}
    fn = getattr(kernel, "fn", None)  # an InterpretedFunction
    if fn is None:
        return set()
    import triton.language as tl

    return {
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.annotation is tl.constexpr or str(p.annotation).endswith("constexpr")
    }


def _checked_launch(run):
    """A kernel's launch that refuses a tensor as a compile-time constant: Triton would run the
    kernel body's methods on it as host Python (the interpreter) or in its code generator. The
    constants' positions are found once per kernel: every launch, timed ones too, pays only a
    lookup per constant."""

    def wrapper(self, *args, **kwargs):
        positions = self.__dict__.get("_constexpr_positions")
        if positions is None:
            names = list(getattr(self, "arg_names", None) or [])
            positions = [(n, names.index(n) if n in names else None) for n in sorted(_constexpr_names(self))]
            self.__dict__["_constexpr_positions"] = positions
        for name, position in positions:
            if name in kwargs:
                value = kwargs[name]
            elif position is not None and position < len(args):
                value = args[position]
            else:
                continue
            if isinstance(value, torch.Tensor) or (
                isinstance(value, tuple | list | dict)
                and any(isinstance(v, torch.Tensor) for v in tree_leaves(value))
            ):
                raise TypeError(f"a tensor passed as the compile-time constant {name} of a kernel")
        if _CURRENT and _CURRENT[-1].first is not None:
            # The call's verdict is made (the runner reports the finding however the call ends):
            # its further launches would only spend the judge's time.
            raise RuntimeError(f"no launch after the watch found {_CURRENT[-1].first}")
        launched = run(self, *args, **kwargs)
        if _CURRENT:
            _CURRENT[-1].after_launch()
        return launched

    wrapper.recforge_wrapped = True
    return wrapper


def prepare_triton(kernel_classes: list[type]) -> None:
    """Triton's launches are watched like the rest of the host code (the grid function runs in
    them, and the interpreter's own copies of the arguments are bookkeeping), and refuse tensors
    as compile-time constants. Only the autotuner's timing statistics (triton.testing's, on
    floats) run with the watch suspended, not the launches it times (_bench_unwatched); the
    screen refuses the hooks that would run the candidate's code beside them (sandbox.screen,
    rule hooks). In the interpreter, where a kernel's
    body is host Python, the autotuner benchmarks nothing (_untimed)."""
    from triton.runtime.autotuner import Autotuner

    for cls in kernel_classes:
        run = cls.__dict__.get("run")
        if run is not None and not getattr(run, "recforge_wrapped", False):
            cls.run = _checked_launch(run)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    bench = Autotuner.__dict__.get("_bench")
    if bench is not None and not getattr(bench, "recforge_wrapped", False):
        Autotuner._bench = _untimed if interpreted else _bench_unwatched(bench)
    if interpreted:
        from triton.runtime import interpreter

        for name in ("_init_args_hst", "_restore_args_dev"):
            copy = interpreter.GridExecutor.__dict__.get(name)
            if copy is not None and not getattr(copy, "recforge_wrapped", False):
                setattr(interpreter.GridExecutor, name, _argument_copies(copy))


# Tensor methods that read values into host Python, which no aten op shows (tolist; printing,
# which torch runs with every mode suspended) or which are bookkeeping on integers (item): on
# floating-point data, host code computing with them.
READS = frozenset(
    {"tolist", "item", "numpy", "__float__", "__int__", "__index__", "__bool__", "__complex__", "__array__",
     "__repr__", "__str__", "__format__"}
)  # fmt: skip


# Of READS, those that read every value of a tensor with no aten op per value (the others come
# down to _local_scalar_dense, which HostOps counts).
BULK_READS = frozenset({"tolist", "numpy", "__array__", "__repr__", "__str__", "__format__"})


class HostReads(TorchFunctionMode):
    """Records, into `ops`, the first read of floating-point values into host Python."""

    def __init__(self, ops: HostOps) -> None:
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.ops.first is None and name in READS and args:
            what = f"Tensor.{name} on {getattr(args[0], 'dtype', '?')}".replace("torch.", "")
            if _floating(args[0]):
                self.ops.first = what
            elif name in BULK_READS and self.ops._unclean(args[0]):
                self.ops.read_unclean(args[0].numel(), what)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watching(
    enabled: bool,
    allowed: frozenset[str] = frozenset(),
    *,
    copies_compute: bool = False,
    inputs=(),
    guarded=(),
) -> Iterator[HostOps | None]:
    """The watch over one call; `inputs`: the call's own tensors, which host code may not write
    and no launch marks as written by a kernel; `guarded`: those of them on memory this process
    can write (compared after each launch: a kernel must not write them either)."""
    if not enabled:
        yield None
        return
    ops = HostOps(allowed, copies_compute=copies_compute, inputs=inputs)
    ops.guard(guarded)
    ops.reads = HostReads(ops)
    _CURRENT.append(ops)
    try:
        with ops, ops.reads:
            yield ops
    finally:
        _CURRENT.remove(ops)
