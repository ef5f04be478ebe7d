"""An op of the kernel library, declared once (kernels.opdef.define makes the public op).

The declaration sits beside the op's problem in search_space/<op>.py: it names the problem (the
signature is its reference's), the default Triton implementation, the fake implementation, the
shape bucket, the launch bounds, the argument checks and the backward. Imports torch only, as
all of search_space does: implementations are named by "module:function" where importing them
would bring Triton.

A forward whose problem declares `statistics` (softmax's log-sum-exp, which its backward reads)
returns them when asked (the problem's `Statistics.flag`), as every implementation of the
problem does; the op asks for them where a backward will follow. A gradient op (`gradient_of`:
the gradient problem `<op>_grad`, fn(grad_out, *the forward's arguments) -> gradients) is
dispatched like any op; its default may read what the forward saved (`default_from_saved`).
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
    """An op's autograd formula, in one of two forms.

    A formula by argument name. `save(ctx, inputs, output)`: keep what the backward needs
    (inputs maps every argument's name to its value). `grads(ctx, *grad_outputs) -> {argument
    name: gradient}`: the gradients of the differentiable arguments (missing ones are None),
    from one gradient per output (None, or zeros, for an output that nothing differentiates);
    `ctx.needs_grad` maps each argument's name to whether its gradient is wanted. Gradients are
    computed with public ops (through `kernels.opdef.public`), so their kernels are dispatched
    too. For a forward with statistics, `output` is (output, statistics) (empty statistics where
    the call saved none), and `grads` gets the output's gradients only: statistics are never
    differentiated.

    Or a gradient op (`gradient_op`, an op declared with gradient_of this one, of a gradient
    problem): the backward keeps every argument (and the output and statistics, where the
    gradient op's default reads them) and calls it as its problem calls a candidate, grad_out
    then the arguments, for the gradients of the `differentiable` arguments the call has (those
    not None), in that order. Its kernels are dispatched like the forward's."""

    save: Callable[[Any, dict[str, Any], Any], None] | None = None
    grads: Callable[[Any, torch.Tensor], dict[str, torch.Tensor | None]] | None = None
    gradient_op: str | None = None
    differentiable: tuple[str, ...] = ()
    # The ops `grads` computes with, by name: defined with this op, so that dispatch knows them
    # (and their library entries) before the first backward.
    uses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        formula = self.save is not None and self.grads is not None
        if formula == (self.gradient_op is not None) or (self.gradient_op is not None) != bool(
            self.differentiable
        ):
            raise ValueError(
                "a backward is a formula (save and grads) or a gradient op and its differentiable arguments"
            )
        if self.gradient_op is not None and self.gradient_op not in self.uses:
            object.__setattr__(self, "uses", (self.gradient_op, *self.uses))


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
    # Where the call gives its launch bounds (below), only from them: a bucket that reads a
    # size from the data syncs the host, which only a call without its bounds may do.
    bucket: Callable[..., str]
    # ValueError naming what is wrong with the arguments (a callable or "module:function").
    check: Callable[..., None] | str | None = None
    # Arguments filled in after `check` and before any implementation sees them (a default that
    # depends on a shape, say): returns {argument name: value} for those it sets.
    prepare: Callable[..., dict[str, Any]] | None = None
    backward: Backward | None = None
    doc: str = ""
    # The dtype that keys dispatch: by default the first tensor argument's.
    dtype_of: Callable[..., torch.dtype] | None = None
    gradient_of: str | None = None  # set for an op that is another op's gradient
    # The launch bounds among its arguments (max lengths, max candidates), by name: given them,
    # an implementation launches without reading a size back from the GPU, so the call never
    # syncs the host and a CUDA graph can capture it. Every implementation receives them, but
    # a library entry whose function names none of them (registered before the op took them).
    bounds: tuple[str, ...] = ()
    # Whether a call's forward has statistics for its backward (problem.statistics), from its
    # arguments: softmax attention saves its lse, silu nothing. None: every call has them.
    saves_statistics: Callable[..., bool] | None = None
    # For a gradient op: a default that reads the forward's saved output and statistics instead
    # of recomputing them, fn(grad_out, *positional arguments, saved_output, saved_statistics,
    # **keyword arguments), called where dispatch picks the default and the backward gives them.
    default_from_saved: Callable[..., Any] | str | None = None
    # One call's (FLOPs, minimum bytes moved) from its arguments, for profiles (roofline
    # fractions per call): it may read sizes from the data, since only a profile calls it.
    cost: Callable[..., tuple[float, float]] | None = None
    # What dispatch runs where Triton cannot run at all; None: the problem's reference.
    reference: Callable[..., Any] | str | None = None
    # Parameters of the reference that are not the op's (how the reference computes, e.g. the
    # dense attention it calls): left out of the op's signature.
    reference_options: tuple[str, ...] = ()
    # The op's signature: by default the reference's, less `reference_options` and the
    # statistics flag (the op asks for its statistics itself), returning the output alone.
    signature: inspect.Signature | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.signature is None:
            object.__setattr__(self, "signature", self._reference_signature())
        unknown = set(self.bounds) - set(self.signature.parameters)
        if unknown:
            raise ValueError(f"op {self.name}: bounds {sorted(unknown)} are not among its arguments")

    @property
    def statistics_flag(self) -> str | None:
        """The keyword that asks a forward for its statistics, or None for an op without them."""
        return None if self.problem.statistics is None else self.problem.statistics.flag

    def _reference_signature(self) -> inspect.Signature:
        reference = self.problem.reference
        hints = typing.get_type_hints(reference)
        left_out = {*self.reference_options, self.statistics_flag}
        params = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in inspect.signature(reference).parameters.values()
            if p.name not in left_out
        ]
        returns = hints.get("return", inspect.Signature.empty)
        if returns is type(None):  # an op that updates its arguments: torch spells it None
            returns = None
        if self.statistics_flag is not None:
            # `output | tuple[output, statistics]`: the reference returns the statistics on request.
            members = typing.get_args(returns)
            if len(members) != 2:
                raise ValueError(
                    f"op {self.name}: its reference returns {returns}, not `output | (output, statistics)`"
                )
            returns = members[0]
        return inspect.Signature(params, return_annotation=returns)

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


def gradient_signature(forward: Op, returns: Any) -> inspect.Signature:
    """The signature of `forward`'s gradient op (a gradient problem's convention): grad_out, then
    the forward's arguments, returning `returns`."""
    grad_out = inspect.Parameter("grad_out", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)
    assert forward.signature is not None
    return forward.signature.replace(
        parameters=[grad_out, *forward.signature.parameters.values()], return_annotation=returns
    )


def get_op(name: str) -> Op:
    """The declaration of op `name`, from the module that declares its problem (OP, or OPS)."""
    from search_space.problem import declarations, problem_module

    module = problem_module(name)
    for op in declarations(module, "OP", Op):
        if op.name == name:
            return op
    raise ValueError(f"problem {name!r} declares no op (no OP or OPS in {module.__name__})")
