"""One op, one declaration: `search_space.op.Op` says everything about an op of the kernel
library once, and `define` makes the public op from it.

An op's declaration names its problem (search_space: the signature, the plain-PyTorch
reference, the shapes, tolerances and FLOP and byte counts the sandbox checks and times), its
default Triton implementation, how to make its outputs' metadata (the fake implementation that
torch.compile and export trace with), its shape bucket, its launch bounds, its argument checks
and its backward. From it, `define` makes:

- the torch custom op `recforge::<name>`, with its schema inferred from the op's signature, its
  fake implementation and, with a backward, its autograd formula;
- the eager fast path (see _EagerOp), with the same formula in a torch.autograd.Function;
- dispatch: every call resolves its (arch, dtype, bucket, graph) through the kernel library
  (kernels.registry.DISPATCHER), which falls back to the default kernel, and to the reference
  where Triton cannot run at all;
- the public function, with the op's signature and the declaration's docstring.

Implementations are called with the op's whole signature, positional arguments positionally
and keyword-only ones by keyword, exactly as the problem calls a candidate: an op whose
signature has launch bounds (a max length, for sync-free calls) gives them to every
implementation, but a library entry registered before the op took them (its function names
none of them).

Statistics. A forward whose problem declares statistics (softmax's log-sum-exp, which its
backward reads) is a custom op with one more argument, the problem's flag (`return_lse`), and
one more output, the statistics (empty, [0], where not asked for). The public function asks for
them where a backward will follow (grad mode on, an input that requires grad, and the
declaration's `saves_statistics`); that call is a training step's and dispatches in the "train"
graph (entries whose training form was not measured slower, kernels.registry.LibraryEntry), any
other in the "serve" graph. Every implementation is asked by the problem's contract, so a
registered forward is the only forward a training step runs; an entry registered before the
contract (its function does not name the flag) computes the output, and one default forward the
statistics.

Gradient ops (`gradient_of`) dispatch in the "train" graph. One whose declaration has a
`default_from_saved` takes two more arguments, the forward's saved output and statistics, which
its default kernel reads instead of running the forward again; a library kernel is called as its
gradient problem calls it, and recomputes what it needs.
"""

from __future__ import annotations

import functools
import inspect
import operator
import typing
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kernels.registry import DISPATCHER, Implementation
from kernels.trace import ACTIVE
from search_space.op import Op, get_op
from search_space.problem import DTYPE_NAMES

Tensor = torch.Tensor  # a module global: looked up on every call's every argument
NAMESPACE = "recforge"
# A gradient op's arguments after its gradient problem's, where its default reads them.
SAVED = ("saved_output", "saved_statistics")


_PUBLIC: dict[str, Callable[..., Any]] = {}


def public(name: str) -> Callable[..., Any]:
    """The public function of a defined op."""
    if name not in _PUBLIC:
        raise ValueError(f"op {name!r} is not defined; defined: {sorted(_PUBLIC)}")
    return _PUBLIC[name]


def defined() -> list[str]:
    return sorted(_PUBLIC)


# --- eager calls ----------------------------------------------------------------------------
#
# A torch custom op costs about 0.1 ms of host time per eager call (its autograd wrapper, the
# redispatch and the guard that keeps torch.compile out of the implementation), more than some
# of these kernels take. In plain eager mode each op runs its implementation directly, with the
# same autograd formula in a torch.autograd.Function; under torch.compile or export tracing, a
# functorch transform, or on tensor subclasses (fake tensors included) it goes through the custom
# op as registered.


def _eager_mode(values: tuple) -> tuple[bool, bool]:
    """(whether the call is plain eager, whether a gradient of it is wanted), in one pass over
    the call's values."""
    grad = torch.is_grad_enabled()
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False, grad and any(isinstance(a, torch.Tensor) and a.requires_grad for a in values)
    plain, wanted = True, False
    for a in values:
        if isinstance(a, Tensor):
            plain = plain and type(a) is Tensor
            wanted = wanted or (grad and a.requires_grad)
    return plain, wanted


class _EagerOp:
    """What the public function of a custom op `op` needs for plain eager calls: `op` itself (the
    path where a call is not plain eager, _eager_mode) and, with a backward, `function`, a
    torch.autograd.Function that runs the op's implementation on the custom op's arguments
    (`split` into the op's arguments and the extra ones, then `run`) with `save` and `backward`
    (the formula registered for the op)."""

    def __init__(
        self,
        op: Callable,
        split: Callable,
        run: Callable,
        save: Callable | None = None,
        backward: Callable | None = None,
    ) -> None:
        self.op = op
        self.function = None
        if backward is not None:
            assert save is not None

            class Function(torch.autograd.Function):
                @staticmethod
                def forward(ctx, *values):
                    output = run(*split(values, {}))
                    save(ctx, values, output)
                    ctx.num_args = len(values)
                    # An output nothing differentiates (statistics returned beside the output,
                    # one part of a split) gets None, not a zero tensor: the formula sees None.
                    ctx.set_materialize_grads(False)
                    return output

                @staticmethod
                def backward(ctx, *grads):
                    if all(g is None for g in grads):  # no output's gradient is wanted
                        return (None,) * ctx.num_args
                    return backward(ctx, *grads)

            self.function = Function


class _NeedsGrad(Mapping):
    """Whether each argument's gradient is wanted, by name (the formula's `ctx.needs_grad`), read
    from the autograd context's flags by position (torch may have left trailing defaults out)."""

    __slots__ = ("_index", "_flags")

    def __init__(self, index: dict[str, int], flags: tuple[bool, ...]) -> None:
        self._index, self._flags = index, flags

    def __getitem__(self, name: str) -> bool:
        i = self._index[name]
        return i < len(self._flags) and self._flags[i]

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


# --- dispatch -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _takes(fn: Callable, names: tuple[str, ...]) -> bool:
    """Whether `fn` names every one of `names` (or takes **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: called as the problem calls it
        return True
    return all(n in parameters for n in names) or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _check_statistics(impl: Implementation, flag: str, got: Any, expected: tuple) -> None:
    """A library entry asked for statistics must return (output..., statistics) shaped as the
    fake implementation says: the backward reads them."""
    want = expected[-1]
    stats = got[-1] if isinstance(got, tuple | list) and len(got) == len(expected) else None
    if isinstance(stats, torch.Tensor) and stats.shape == want.shape and stats.dtype == want.dtype:
        return
    what = (
        f"statistics {tuple(stats.shape)} {stats.dtype}"
        if isinstance(stats, torch.Tensor)
        else type(got).__name__
    )
    raise RuntimeError(
        f"library kernel {impl.name!r} given {flag}=True returned {what}, expected (output, statistics "
        f"{tuple(want.shape)} {want.dtype})"
    )


# --- define ---------------------------------------------------------------------------------


def _binder(name: str, sig: inspect.Signature, extra: tuple[str, ...] = ()) -> Callable[..., tuple]:
    """A function with the signature `sig` that returns its arguments' values as (positional
    ones, {keyword-only one: value}, the values of `extra`, the last keyword-only ones): Python's
    own binding, about a hundred times faster than inspect.Signature.bind (whose tens of
    microseconds a public op would pay on every call), with the same errors, under the op's name."""
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    positional, keyword = [], []
    for n, p in sig.parameters.items():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise ValueError(f"op {name}: a signature without *args or **kwargs, please ({n})")
        (keyword if p.kind is inspect.Parameter.KEYWORD_ONLY else positional).append(n)
    assert keyword[len(keyword) - len(extra) :] == list(extra)

    def text(n: str) -> str:
        return f"{n}=_defaults[{n!r}]" if n in defaults else n

    arguments = ", ".join([*map(text, positional), *(["*", *map(text, keyword)] if keyword else [])])
    named = ", ".join(f"{n!r}: {n}" for n in keyword if n not in extra)
    returns = f"({''.join(f'{n}, ' for n in positional)}), {{{named}}}, ({''.join(f'{n}, ' for n in extra)})"
    namespace = {"_defaults": defaults}
    exec(f"def {name}({arguments}):\n    return {returns}\n", namespace)
    return namespace[name]


def _getter(positions: list[int]) -> Callable[[tuple], tuple]:
    """values -> the values at `positions`, a tuple (operator.itemgetter, which runs in C)."""
    if len(positions) == 1:
        (i,) = positions
        return lambda values: (values[i],)
    return operator.itemgetter(*positions) if positions else lambda values: ()


def _is_tensor(annotation: Any) -> bool:
    """A parameter annotated as a tensor, or a tensor or None."""
    return annotation is Tensor or set(typing.get_args(annotation)) == {Tensor, type(None)}


def _through_gradient_op(
    op: Op, has_statistics: bool, outputs: int | None, gradient_call: list[Callable]
) -> tuple[Callable, Callable]:
    """(save, backward) of an op whose backward is its gradient op (search_space.op.Backward):
    save keeps the tensor arguments with save_for_backward (and the output and statistics, where
    the gradient op's default reads them and the call kept them), the others as they are;
    backward puts the arguments back in order and calls the gradient op (`gradient_call[0]`: its
    call_flat) with grad_out. `values` are the custom op's: the op's arguments, then the flag."""
    gradient = get_op(op.backward.gradient_op)
    if gradient.gradient_of != op.name:
        raise ValueError(f"op {op.name}: its gradient op {gradient.name} is not declared gradient_of it")
    if outputs:
        raise ValueError(f"op {op.name}: a gradient op takes one grad_out, for an op of one output")
    params = list(op.signature.parameters.values())
    names = [p.name for p in params]
    unknown = set(op.backward.differentiable) - set(names)
    if unknown:
        raise ValueError(f"op {op.name}: differentiable {sorted(unknown)} are not among its arguments")
    tensor_at = [i for i, p in enumerate(params) if _is_tensor(p.annotation)]
    other_at = [i for i in range(len(params)) if i not in tensor_at]
    num_tensors = len(tensor_at)
    get_tensors, get_others = _getter(tensor_at), _getter(other_at)
    # (*saved tensors, *others) -> the arguments in order
    in_order = _getter(sorted(range(len(params)), key=lambda j: (tensor_at + other_at)[j]))
    differentiable = [names.index(n) for n in op.backward.differentiable]
    optional = any(params[i].default is None for i in differentiable)  # an argument a call may leave out
    reads_saved = has_statistics and gradient.default_from_saved is not None
    keyword = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    num_positional, saves = len(params) - len(keyword), op.saves_statistics

    def kept_statistics(values: tuple) -> bool:
        """Whether the call kept the statistics its backward reads: it asked for them (its last
        value, the flag), or it has none to keep (silu). A call that did not, though a backward
        follows (under a functorch transform, say), leaves the gradient op to recompute them."""
        if values[len(params)]:
            return True
        kwargs = dict(zip(keyword, values[num_positional : len(params)], strict=True))
        return saves is not None and not saves(*values[:num_positional], **kwargs)

    def save(ctx, values: tuple, output) -> None:
        keep = reads_saved and kept_statistics(values)
        ctx.save_for_backward(*get_tensors(values), *(output if keep else ()))
        ctx.others = get_others(values)
        # The gradient op returns the gradients of the differentiable arguments the call has.
        ctx.grad_at = [i for i in differentiable if values[i] is not None] if optional else differentiable

    def backward(ctx, grad_out, *grad_statistics):
        grads = [None] * len(ctx.needs_input_grad)
        if grad_out is None:  # only the statistics reached the backward: they are not differentiated
            return tuple(grads)
        saved = ctx.saved_tensors
        values = in_order((*saved[:num_tensors], *ctx.others))
        got = gradient_call[0](grad_out, *values, *saved[num_tensors:])
        for i, grad in zip(ctx.grad_at, got, strict=True):
            grads[i] = grad
        return tuple(grads)

    return save, backward


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


def _autocast_off(args: tuple, kwargs: dict):
    """Autocast off for an op's implementation or backward formula: the op is not cast by autocast
    (its arguments arrive in the dtypes the caller gave), and neither may the torch ops inside
    it be (a reference's fp32 accumulation, a formula's index_add into a buffer of the
    argument's dtype)."""
    tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
    device = tensor.device.type if tensor is not None else "cuda"
    return torch.autocast(device_type=device, enabled=False)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))


def _outputs(returns: Any) -> int | None:
    """How many outputs a return annotation has: None for one (a tensor or a list of them)."""
    return len(typing.get_args(returns)) if typing.get_origin(returns) is tuple else None


def define(op: Op) -> Callable[..., Any]:
    """The public function of `op`, registered as a custom op and for dispatch (once per name),
    with the ops its backward uses."""
    if op.name in _PUBLIC:
        return _PUBLIC[op.name]
    check = op.resolve(op.check) if op.check is not None else None
    reference = op.resolve(op.reference) if op.reference is not None else op.problem.reference
    DISPATCHER.register_op(
        op.name, default=op.resolve(op.default), reference=reference, gradient_of=op.gradient_of
    )
    sig = op.signature
    assert sig is not None
    names = list(sig.parameters)
    keyword = [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    n_positional, n_op = len(names) - len(keyword), len(names)
    index = {n: i for i, n in enumerate(names)}
    dtype_of = op.dtype_of  # None: the first tensor argument's
    bounds = op.bounds
    graph_of_call = "train" if op.gradient_of is not None else "serve"
    flag = op.statistics_flag if op.gradient_of is None else None
    flag_kwargs = {flag: True} if flag is not None else {}
    from_saved = op.resolve(op.default_from_saved) if op.default_from_saved is not None else None
    outputs = _outputs(sig.return_annotation)  # the op's own, without statistics

    # The custom op's arguments after the op's: the statistics flag, or a gradient op's saved tensors.
    optional_tensor = torch.Tensor | None
    if flag is not None:
        extra = [inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool)]
    elif from_saved is not None:
        extra = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=optional_tensor)
            for n in SAVED
        ]
    else:
        extra = []
    returns = sig.return_annotation
    if flag is not None:
        returns = (
            tuple[(*typing.get_args(returns), torch.Tensor)] if outputs else tuple[returns, torch.Tensor]
        )
    # The custom op takes every argument positionally (torch.library refuses keyword-only tensors).
    flat = inspect.Signature(
        [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in (*sig.parameters.values(), *extra)],
        return_annotation=returns,
    )
    n_all = len(flat.parameters)
    all_names = list(flat.parameters)

    def split(values: tuple, named: dict) -> tuple[tuple, dict, tuple]:
        """The op's (args, kwargs) and the extra arguments' values, from the custom op's values
        (torch may leave defaults out)."""
        if named or len(values) != n_all:
            bound = flat.bind(*values, **named)
            bound.apply_defaults()
            values = tuple(bound.arguments[n] for n in all_names)
        return (
            values[:n_positional],
            dict(zip(keyword, values[n_positional:n_op], strict=True)),
            values[n_op:],
        )

    def pack(output: Any, statistics: torch.Tensor) -> tuple:
        return (*output, statistics) if outputs else (output, statistics)

    def run(args: tuple, kwargs: dict, extras: tuple):
        """The call on the op's arguments and the extra ones, traced where a trace is on, and
        outside autocast (see _autocast_off)."""
        if _autocast_on():
            with _autocast_off(args, kwargs):
                return run(args, kwargs, extras)
        if not ACTIVE:
            return dispatch(args, kwargs, extras)
        return ACTIVE[-1].record(op, args, kwargs, lambda: dispatch(args, kwargs, extras))

    def dispatch(args: tuple, kwargs: dict, extras: tuple):
        """The call on the op's arguments and the extra ones: dispatch, then the implementation."""
        first = args[0] if isinstance(args[0], Tensor) else _first_tensor(args, kwargs)
        dtype = first.dtype if dtype_of is None else dtype_of(*args, **kwargs)
        asked = flag is not None and extras[0]
        chosen = DISPATCHER.resolve(
            op.name,
            device=first.device,
            dtype=DTYPE_NAMES.get(dtype) or str(dtype),
            bucket=op.bucket(*args, **kwargs),
            graph="train" if asked else graph_of_call,
        )
        fn, given = chosen.fn, kwargs
        if bounds and chosen.library is not None and not _takes(fn, bounds):
            given = {k: v for k, v in kwargs.items() if k not in bounds}
        if flag is not None:
            if not asked:
                return pack(fn(*args, **given), first.new_empty(0, dtype=torch.float32))
            if chosen.name == "reference":
                # Where Triton cannot run, the gradient op runs its reference too, which never
                # reads saved statistics: they are not computed, only shaped (zeros).
                return pack(fn(*args, **given), op.fake(*args, **kwargs, **flag_kwargs)[-1].zero_())
            if chosen.library is None:  # the default keeps the problem's contract
                return tuple(fn(*args, **given, **flag_kwargs))
            if _takes(fn, (flag,)):  # the contract: the sandbox checked these with the output
                got = fn(*args, **given, **flag_kwargs)
                _check_statistics(chosen, flag, got, op.fake(*args, **kwargs, **flag_kwargs))
                return tuple(got)
            # An entry registered before the contract returned statistics computes the output
            # alone; they come from one default forward.
            output = fn(*args, **given)
            return pack(output, DISPATCHER.default(op.name)(*args, **kwargs, **flag_kwargs)[-1])
        if from_saved is not None and chosen.name == "default" and extras[0] is not None:
            return from_saved(*args, *extras, **kwargs)
        return fn(*args, **given)

    def impl(*values, **named):
        return run(*split(values, named))

    impl.__signature__ = flat
    impl.__name__ = op.name
    # An op that updates arguments in place (an optimizer's weights and state) says so, so that
    # torch.compile and export functionalize it.
    custom = torch.library.custom_op(f"{NAMESPACE}::{op.name}", mutates_args=op.problem.updates)(impl)

    def fake(*values, **named):
        args, kwargs, extras = split(values, named)
        if flag is None:
            return op.fake(*args, **kwargs)
        if extras[0]:
            return tuple(op.fake(*args, **kwargs, **flag_kwargs))
        return pack(op.fake(*args, **kwargs), _first_tensor(args, kwargs).new_empty(0, dtype=torch.float32))

    fake.__signature__ = flat
    custom.register_fake(fake)

    save = backward = None
    gradient_call: list[Callable] = []  # the gradient op's call_flat, once it is defined
    if op.backward is not None and op.backward.gradient_op is not None:
        save, backward = _through_gradient_op(op, flag is not None, outputs, gradient_call)
    elif op.backward is not None:
        formula = op.backward
        known = frozenset(names)

        def save(ctx, values: tuple, output) -> None:
            """`values`: the custom op's, every one given (the op's arguments first, in order)."""
            formula.save(ctx, dict(zip(names, values, strict=False)), output)  # extras last

        def backward(ctx, *grad_outputs):
            if flag is not None:  # statistics are never differentiated
                grad_outputs = grad_outputs[:-1]
            flags = ctx.needs_input_grad
            ctx.needs_grad = _NeedsGrad(index, flags)
            if _autocast_on():
                with _autocast_off(grad_outputs, {}):
                    grads = formula.grads(ctx, *grad_outputs)
            else:
                grads = formula.grads(ctx, *grad_outputs)
            assert grads.keys() <= known, f"{op.name}'s backward returned gradients of {set(grads) - known}"
            return tuple(map(grads.get, all_names if len(flags) == n_all else all_names[: len(flags)]))

    if op.backward is not None:

        def setup_context(ctx, inputs, output):
            args, kwargs, extras = split(tuple(inputs), {})
            save(ctx, (*args, *kwargs.values(), *extras), output)

        torch.library.register_autograd(f"{NAMESPACE}::{op.name}", backward, setup_context=setup_context)
    call = _EagerOp(custom, split, run, save, backward)

    public_sig = sig.replace(parameters=[*sig.parameters.values(), *(extra if from_saved else ())])
    bind = _binder(op.name, public_sig, SAVED if from_saved else ())
    prepare, saves, function = op.prepare, op.saves_statistics, call.function

    def public_fn(*a, **kw):
        args, kwargs, extras = bind(*a, **kw)
        if check is not None:
            check(*args, **kwargs)
        if prepare is not None:
            for n, value in prepare(*args, **kwargs).items():
                if n in kwargs:
                    kwargs[n] = value
                else:
                    i = index[n]
                    args = (*args[:i], value, *args[i + 1 :])
        flat = (*args, *kwargs.values())
        plain, needs_grad = _eager_mode(flat)
        if flag is not None:
            # Statistics where a backward will read them: a training step's call.
            extras = (needs_grad and (saves is None or saves(*args, **kwargs)),)
        flat = (*flat, *extras)
        if not plain:
            result = call.op(*flat)
        elif needs_grad and function is not None:
            result = function.apply(*flat)
        else:
            result = run(args, kwargs, extras)
        if flag is None:
            return result
        return result[:-1] if outputs else result[0]

    def call_flat(*flat):
        """The op on every argument in the order of its signature, positionally, the extra ones
        last, as the custom op takes them: for a caller that holds them so (a backward formula
        calling a gradient op). No binding, check or prepare: the caller's arguments are final."""
        plain, needs_grad = _eager_mode(flat)
        if not plain:
            return call.op(*flat)
        if needs_grad and function is not None:
            return function.apply(*flat)
        return run(*split(flat, {}))

    public_fn.__signature__ = public_sig
    public_fn.__name__ = public_fn.__qualname__ = op.name
    public_fn.__doc__ = op.doc or op.problem.description
    public_fn.op = op
    public_fn.custom_op = custom
    public_fn.eager = call  # the eager fast path, whose `op` is the custom op it falls back to
    public_fn.call_flat = call_flat
    _PUBLIC[op.name] = public_fn
    if op.backward is not None:
        for name in op.backward.uses:
            define(get_op(name))
        if op.backward.gradient_op is not None:
            gradient_call.append(_PUBLIC[op.backward.gradient_op].call_flat)
    return public_fn
