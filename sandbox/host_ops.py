"""The host-compute watch: which torch ops a candidate's host code runs on floating-point data.

A candidate computes its op in Triton kernels; its host code allocates, views, copies and casts
tensors and may compute on integer ones (offsets, lengths, schedules) that no kernel wrote: an
integer or boolean argument of a launch may hold what the kernel made of floating-point data
(its bits, its values scaled), so host ops on it, or on a copy of it, count as on floats. Any
other torch op with a floating-point tensor among its inputs or outputs is host code computing
the op itself (a gather by indexing, a product by an operator, a sum by a builtin), which no
static screen of Python can see: tensors and numbers look alike there; so is reading
floating-point values into Python (tolist, item), which dispatches no such op. Integers made
from floating-point data on the host (a cast) count as a kernel's, and so do integer tensors the
call made before a launch (a compiled kernel can write any of the runner's GPU memory, not only
its arguments). The call's own inputs are read-only: host code never writes them (such a write
is refused and reported), and a kernel that writes them is reported (on a GPU their memory is
mapped read-only, sandbox.shared; elsewhere they are compared after each launch). The runner
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
    touches floating-point data, or floating-point data viewed as integers."""

    def __init__(
        self, allowed: frozenset[str] = frozenset(), *, copies_compute: bool = False, inputs=()
    ) -> None:
        super().__init__()
        self.allowed = (BOOKKEEPING - DATA_MOVEMENT if copies_compute else BOOKKEEPING) | allowed
        self.first: str | None = None
        # Integer and boolean data a Triton kernel may have written (every such argument of a
        # launch but the call's own inputs, and copies of it), by storage: what a kernel writes
        # can be a floating-point tensor's bits or values, whatever its dtype, so host ops on it
        # count as on floats. A few of its values may be read (a flag, a count): READ_BUDGET.
        self.device_written: set[tuple[int, int]] = set()
        self.inputs = {_storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
        self.values_read = 0
        # Integer and boolean tensors the call made (by storage): a compiled kernel can reach
        # them by pointer arithmetic from its arguments, so each launch marks them all.
        self.made: set[tuple[int, int]] = set()
        # The inputs whose writes no mapping prevents, with their bits at the call's start.
        self.guarded: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.reads: HostReads | None = None
        self.launching = 0  # inside a Triton launch (the interpreter writes its arguments back)

    def guard(self, tensors) -> None:
        """Keep the bits of `tensors` (inputs on writable memory) to compare after each launch."""
        with _disable_current_modes():
            self.guarded = [(t, _bits(t).clone()) for t in tensors if isinstance(t, torch.Tensor)]

    def after_launch(self, args) -> None:
        """What a launch may have written: its integer arguments and every integer tensor the
        call made, and, where writes are not prevented, the call's inputs."""
        self.mark_written(args)
        self.device_written |= self.made
        if self.first is None and self.guarded:
            with _disable_current_modes():
                for t, before in self.guarded:
                    if not torch.equal(_bits(t), before):
                        self.first = (
                            f"a kernel writing into the call's input ({t.dtype}, {list(t.shape)})".replace(
                                "torch.", ""
                            )
                        )
                        break

    def mark_written(self, tensors) -> None:
        for t in tensors:
            if (
                isinstance(t, torch.Tensor)
                and not _floating(t)
                and (key := _storage_key(t)) not in self.inputs
            ):
                self.device_written.add(key)

    def _written(self, t) -> bool:
        return (
            bool(self.device_written)
            and isinstance(t, torch.Tensor)
            and not _floating(t)
            and _storage_key(t) in self.device_written
        )

    def read_written(self, count: int, what: str) -> None:
        """`count` values of device-written data read into Python: past READ_BUDGET, reading data."""
        self.values_read += count
        if self.first is None and self.values_read > READ_BUDGET:
            self.first = f"{what} ({self.values_read} values a kernel wrote, read into Python)"

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Read when the class is made (TorchDispatchMode.__init_subclass__): True would wrap
        # __torch_dispatch__ in torch._disable_dynamo, whose first call imports torch._dynamo,
        # two to three seconds of every runner's CPU time. Nothing compiles under the watch
        # (the screen admits no torch.compile), so there is no Dynamo to keep out of it.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Rule read-only inputs: host code never writes the call's inputs (a stash for the
        # data's bits, put back before the call returns, would otherwise pass every check). The
        # write is not made; the first such op is reported.
        # Inside a launch the interpreter copies every argument back, changed or not: a kernel's
        # (or a launch hook's) write there is the comparison's to find (after_launch), or faults
        # on read-only memory.
        target = None if self.launching else _written_input(func, args, kwargs, self.inputs)
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
        outputs = tree_leaves(out)
        written = [t for t in inputs if self._written(t)]
        if written or any(_floating(t) for t in inputs):
            # A copy of device-written data is device-written too, and integers made from
            # floating-point data (a cast of values scaled to integers) are the data.
            self.mark_written(outputs)
        for t in outputs:
            if (
                isinstance(t, torch.Tensor)
                and not _floating(t)
                and (key := _storage_key(t)) not in self.inputs
            ):
                self.made.add(key)
        if self.first is None and func.overloadpacket.__name__ not in self.allowed:
            floating = [t for t in [*inputs, *tree_leaves(out)] if _floating(t)]
            if floating:
                self.first = f"{func} on {floating[0].dtype}".replace("torch.", "")
            elif written:
                self.first = f"{func} on {written[0].dtype} a kernel wrote".replace("torch.", "")
        elif written and func is torch.ops.aten._local_scalar_dense.default:
            self.read_written(1, f"{func} on {written[0].dtype}".replace("torch.", ""))
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as integers of its element size (NaNs compare equal to themselves so)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if not (t.is_floating_point() or t.is_complex()):
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


_MUTATED: dict[object, tuple[tuple[int, str], ...]] = {}


def _written_input(func, args, kwargs, inputs: set) -> torch.Tensor | None:
    """The first of the call's inputs (by storage) that op `func` writes, or None."""
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
            if isinstance(leaf, torch.Tensor) and _storage_key(leaf) in inputs:
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
        ops = _CURRENT[-1] if _CURRENT else None
        if ops is None:
            return run(self, *args, **kwargs)
        ops.launching += 1
        try:
            launched = run(self, *args, **kwargs)
        finally:
            ops.launching -= 1
        ops.after_launch([*tree_leaves(args), *tree_leaves(kwargs)])
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
    bench = Autotuner.__dict__.get("_bench")
    if bench is not None and not getattr(bench, "recforge_wrapped", False):
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        Autotuner._bench = _untimed if interpreted else _bench_unwatched(bench)


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
            elif name in BULK_READS and self.ops._written(args[0]):
                self.ops.read_written(args[0].numel(), what)
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
