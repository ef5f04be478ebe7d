"""An op of the kernel library, declared once (kernels.opdef.define makes the public op).

The declaration sits beside the op's problem in search_space/<op>.py: it names the problem (the
signature is its reference's), the default Triton implementation, the fake implementation, the
shape bucket, the argument checks and the backward. Imports torch only, as all of search_space
does: implementations are named by "module:function" where importing them would bring Triton.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from search_space.problem import Problem


@dataclass(frozen=True, kw_only=True)
class Backward:
    """An op's autograd formula, by argument name.

    `save(ctx, inputs, output)`: keep what the backward needs (inputs maps every argument's name
    to its value). `grads(ctx, *grad_outputs) -> {argument name: gradient}`: the gradients of
    the differentiable arguments (missing ones are None), from one gradient per output (None,
    or zeros, for an output that nothing differentiates); `ctx.needs_grad` maps each argument's
    name to whether its gradient is wanted. Gradients are computed with public ops (through
    `kernels.opdef.public`), so their kernels are dispatched too."""

    save: Callable[[Any, dict[str, Any], Any], None]
    grads: Callable[[Any, torch.Tensor], dict[str, torch.Tensor | None]]


@dataclass(frozen=True, kw_only=True)
class Op:
    """An op of the kernel library. Every callable takes the op's signature (the reference's)."""

    name: str
    problem: Problem  # signature, reference, shapes, tolerances, flops and bytes
    # The default Triton implementation: a callable, or "module:function" (kernels.<op>), which
    # keeps a declaration in search_space free of Triton (the sandbox's judge loads it).
    default: Callable[..., Any] | str
    fake: Callable[..., Any]  # empty outputs of the right shapes and dtypes (meta tensors in, out)
    # The shape bucket of a call, from shapes and scalar arguments only (never data: dispatch
    # must not sync the host); the problem's `bucket` names its timing shapes' buckets alike.
    bucket: Callable[..., str]
    # ValueError naming what is wrong with the arguments (a callable or "module:function").
    check: Callable[..., None] | str | None = None
    backward: Backward | None = None
    doc: str = ""
    # The dtype that keys dispatch: by default the first tensor argument's.
    dtype_of: Callable[..., torch.dtype] | None = None
    gradient_of: str | None = None  # set for an op that is another op's gradient
    signature: inspect.Signature = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        reference = self.problem.reference
        hints = typing.get_type_hints(reference)
        params = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in inspect.signature(reference).parameters.values()
        ]
        sig = inspect.Signature(params, return_annotation=hints.get("return", inspect.Signature.empty))
        object.__setattr__(self, "signature", sig)

    @staticmethod
    def resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
        """A callable, or the function a "module:function" string names."""
        if callable(target):
            return target
        module, _, name = target.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load {target!r}: {exc}") from exc


def get_op(name: str) -> Op:
    """The declaration of op `name`, from the module that declares its problem (OP, or OPS)."""
    from search_space.problem import declarations, problem_module

    module = problem_module(name)
    for op in declarations(module, "OP", Op):
        if op.name == name:
            return op
    raise ValueError(f"problem {name!r} declares no op (no OP or OPS in {module.__name__})")
