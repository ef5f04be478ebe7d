"""One op, one declaration: `search_space.op.Op` says everything about an op of the kernel
library once, and `define` makes the public op from it.

An op's declaration names its problem (search_space: the signature, the plain-PyTorch
reference, the shapes, tolerances and FLOP and byte counts the sandbox checks and times), its
default Triton implementation, how to make its outputs' metadata (the fake implementation that
torch.compile and export trace with), its shape bucket, its argument checks and its backward.
From it, `define` makes:

- the torch custom op `recforge::<name>`, with its schema inferred from the reference's
  signature, its fake implementation and, with a backward, its autograd formula;
- the eager fast path (see _EagerOp), with the same formula in a torch.autograd.Function;
- dispatch: every call resolves its (arch, dtype, bucket) through the kernel library
  (kernels.registry.DISPATCHER), which falls back to the default kernel, and to the reference
  where Triton cannot run at all;
- the public function, with the reference's signature and the declaration's docstring.

Implementations are called with the op's whole signature, positional arguments positionally
and keyword-only ones by keyword, exactly as the problem calls a candidate: an op whose
signature has launch bounds (a max length, for sync-free calls) gives them to every
implementation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from kernels.registry import DISPATCHER
from search_space.op import Op
from search_space.problem import DTYPES

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
NAMESPACE = "recforge"


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


def _plain_eager(args: tuple) -> bool:
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))


class _EagerOp:
    """Calls `op` (a custom op) as its implementation `impl` where _plain_eager allows, with
    `setup_context` and `backward` (the formula registered for the op, if any) for autograd."""

    def __init__(
        self,
        op: Callable,
        impl: Callable,
        setup_context: Callable | None = None,
        backward: Callable | None = None,
    ) -> None:
        self.op, self.impl = op, impl
        self.function = None
        if backward is not None:
            assert setup_context is not None

            class Function(torch.autograd.Function):
                @staticmethod
                def forward(ctx, *args):
                    output = impl(*args)
                    setup_context(ctx, args, output)
                    ctx.num_args = len(args)
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

    def __call__(self, *args):
        if not _plain_eager(args):
            return self.op(*args)
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        )
        if self.function is not None and needs_grad:
            return self.function.apply(*args)
        return self.impl(*args)


# --- define ---------------------------------------------------------------------------------


def _binder(name: str, sig: inspect.Signature) -> Callable[..., tuple]:
    """A function with the op's signature that returns every argument's value in order:
    Python's own binding, about a hundred times faster than inspect.Signature.bind (whose tens of
    microseconds a public op would pay on every call), with the same errors, under the op's name."""
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    positional, keyword = [], []
    for n, p in sig.parameters.items():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise ValueError(f"op {name}: a signature without *args or **kwargs, please ({n})")
        text = f"{n}=_defaults[{n!r}]" if n in defaults else n
        (keyword if p.kind is inspect.Parameter.KEYWORD_ONLY else positional).append(text)
    arguments = ", ".join(positional + (["*", *keyword] if keyword else []))
    namespace = {"_defaults": defaults}
    exec(f"def {name}({arguments}):\n    return ({', '.join(sig.parameters)},)\n", namespace)
    return namespace[name]


def _first_tensor_dtype(*args, **kwargs) -> torch.dtype:
    return next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)).dtype


def define(op: Op) -> Callable[..., Any]:
    """The public function of `op`, registered as a custom op and for dispatch (once per name)."""
    if op.name in _PUBLIC:
        return _PUBLIC[op.name]
    check = op.resolve(op.check) if op.check is not None else None
    DISPATCHER.register_op(
        op.name, default=op.resolve(op.default), reference=op.problem.reference, gradient_of=op.gradient_of
    )
    sig = op.signature
    names = list(sig.parameters)
    keyword = [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    n_positional = len(names) - len(keyword)
    dtype_of = op.dtype_of or _first_tensor_dtype

    # The custom op takes every argument positionally (torch.library refuses keyword-only tensors).
    flat = sig.replace(
        parameters=[p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in sig.parameters.values()]
    )

    def split(values: tuple, named: dict) -> tuple[tuple, dict]:
        """The op's (args, kwargs) from the custom op's values (torch may leave defaults out)."""
        if not named and len(values) == len(names):  # every value, in order: no binding to do
            return values[:n_positional], dict(zip(keyword, values[n_positional:], strict=True))
        bound = flat.bind(*values, **named)
        bound.apply_defaults()
        ordered = [bound.arguments[n] for n in names]
        return tuple(ordered[:n_positional]), dict(zip(keyword, ordered[n_positional:], strict=True))

    def impl(*values, **named):
        args, kwargs = split(values, named)
        device = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)).device
        dtype = dtype_of(*args, **kwargs)
        chosen = DISPATCHER.resolve(
            op.name,
            device=device,
            dtype=_DTYPE_NAMES.get(dtype, str(dtype)),
            bucket=op.bucket(*args, **kwargs),
        )
        return chosen.fn(*args, **kwargs)

    impl.__signature__ = flat
    impl.__name__ = op.name
    custom = torch.library.custom_op(f"{NAMESPACE}::{op.name}", mutates_args=())(impl)

    def fake(*values, **named):
        args, kwargs = split(values, named)
        return op.fake(*args, **kwargs)

    fake.__signature__ = flat
    custom.register_fake(fake)

    setup_context = backward = None
    if op.backward is not None:
        formula = op.backward

        def setup_context(ctx, inputs, output):
            args, kwargs = split(tuple(inputs), {})
            formula.save(ctx, dict(zip(names, (*args, *kwargs.values()), strict=True)), output)

        def backward(ctx, *grad_outputs):
            given = len(ctx.needs_input_grad)  # torch may have left trailing defaults out
            ctx.needs_grad = {n: i < given and ctx.needs_input_grad[i] for i, n in enumerate(names)}
            grads = formula.grads(ctx, *grad_outputs)
            unknown = set(grads) - set(names)
            assert not unknown, f"{op.name}'s backward returned gradients of unknown arguments {unknown}"
            return tuple(grads.get(n) for n in names[:given])

        torch.library.register_autograd(f"{NAMESPACE}::{op.name}", backward, setup_context=setup_context)
    call = _EagerOp(custom, impl, setup_context, backward)

    bind = _binder(op.name, sig)

    def public_fn(*args, **kwargs):
        values = bind(*args, **kwargs)
        if check is not None:
            check(*values[:n_positional], **dict(zip(keyword, values[n_positional:], strict=True)))
        return call(*values)

    public_fn.__signature__ = sig
    public_fn.__name__ = public_fn.__qualname__ = op.name
    public_fn.__doc__ = op.doc or op.problem.description
    public_fn.op = op
    public_fn.custom_op = custom
    _PUBLIC[op.name] = public_fn
    return public_fn
