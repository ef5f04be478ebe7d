"""The gradients of the attention ops as problems of their own, so the sandbox checks backward
kernels the way it checks forwards and the search can tune their tiling.

A gradient problem's call is the forward's inputs plus `grad_out` (first); it returns the
gradients of every differentiable input: (dq, dk, dv), and d rel_bias where the call has a bias.
How a candidate gets the forward statistics it needs (a softmax's row sums) is its own affair:
the timed call goes from inputs to gradients. The reference is autograd of the forward's
reference in fp32 (fp64 when given fp64); baselines are autograd of the forward's baselines.

    FLOPs   = 2.5 x the forward's (q.k recomputed, dP = dO v^T, dV = P^T dO, dQ, dK)
    bytes   = 2.5 x the forward's minimum traffic (q, k, v, dO and O read; dq, dk, dv written)

Each gradient problem is an op too (`gradient_op`: search_space/<op>_grad.py's OP), which the
forward op's backward calls (search_space.op.Backward's gradient_op), so dispatch runs a
registered backward kernel in training the way it runs a forward one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.utils.checkpoint

from search_space.attention import dense_attention
from search_space.attention_common import BACKWARD_MODULE, gradient_cost, library_template
from search_space.op import Op, gradient_signature
from search_space.problem import Inputs, Problem, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

BACKWARD_FLOP_FACTOR = 2.5

# Gradients go through more roundings than the forward (dS = P (dP - delta) subtracts two
# nearly equal terms, with delta = rowsum(dO * O) from the rounded O, an error shared by a
# whole row; dK of target attention sums such errors over thousands of queries): correct bf16
# kernels stay within these on the check shapes (two dK elements of a 2000-key history reached
# 0.2 of the RMS), and a dropped key or a wrong mask is far outside the norm bound. A gradient
# that is exactly zero (dq of a one-key softmax row) is compared against a twentieth of
# grad_out's RMS instead of its own zero RMS (`grad_error_scale`): at a scale that is not a
# power of two, a correct fp32 kernel leaves 1.2e-6 there where the reference has 0.
# Per row (a token's gradient over all heads), as the forward's: three times the norm bound's
# fraction of the error scale, plus two units of rounding of the row's own norm.
GRAD_TOLERANCES = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-4, norm_rtol=2e-5, row_rtol=1e-5, row_atol=6e-5),
    "bf16": Tolerance(atol=3e-1, rtol=5e-2, norm_rtol=1.5e-2, row_rtol=2**-7, row_atol=4.5e-2),
    "fp16": Tolerance(atol=2e-2, rtol=1e-2, norm_rtol=3e-3, row_rtol=2**-10, row_atol=9e-3),
}

NUM_DIFFERENTIABLE = 3  # q, k, v lead every attention op's arguments


def gradients_of(forward: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """fn(grad_out, *args, **kwargs) -> autograd gradients of `forward(*args, **kwargs)` for
    q, k, v (and rel_bias where given), computed in fp32 (fp64 for fp64), in the inputs' dtypes."""

    def grads(grad_out: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        acc = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
        originals = list(args[:NUM_DIFFERENTIABLE])
        names = [None] * NUM_DIFFERENTIABLE
        if kwargs.get("rel_bias") is not None:
            originals.append(kwargs["rel_bias"])
            names.append("rel_bias")
        leaves = [t.detach().to(acc).requires_grad_() for t in originals]
        call_args = (*leaves[:NUM_DIFFERENTIABLE], *args[NUM_DIFFERENTIABLE:])
        call_kwargs = dict(kwargs)
        for name, leaf in zip(names, leaves, strict=True):
            if name is not None:
                call_kwargs[name] = leaf
        with torch.enable_grad():
            # Each sequence's dense attention is recomputed in the backward instead of kept:
            # autograd of the whole loop would hold every sequence's score matrix at once (68 GB
            # of fp32 scores at 256 sequences of 4096 keys), which no GPU holds.
            out = forward(*call_args, attend=_recomputed_dense_attention, **call_kwargs)
            if out.requires_grad:
                found = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
            else:  # nothing attends to anything (empty sequences): every gradient is zero
                found = (None,) * len(leaves)
        return tuple(
            (torch.zeros_like(leaf) if g is None else g).to(t.dtype)
            for g, leaf, t in zip(found, leaves, originals, strict=True)
        )

    return grads


def _recomputed_dense_attention(*args, **kwargs) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(dense_attention, *args, use_reentrant=False, **kwargs)


def grad_error_scale(inputs: Inputs) -> float:
    """A floor under each gradient's RMS: a twentieth of the upstream gradient's."""
    grad_out = inputs.args[0]
    return 0.05 * grad_out.double().pow(2).mean().sqrt().item() if grad_out.numel() else 0.0


def grad_problem(
    forward: Problem,
    *,
    output_shape: Callable[[Inputs], tuple[int, ...]],
    timing_shapes: tuple[Shape, ...],
) -> Problem:
    """The gradient problem of `forward` (see the module docstring). `output_shape` gives the
    forward's output shape from its inputs (grad_out has it); `timing_shapes` are the forward's
    shapes where the baselines' autograd fits in memory."""
    name = f"{forward.name}_grad"

    def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
        fwd = forward.without_statistics(forward.make_inputs(shape, seed, device))
        gen = torch.Generator(device=device).manual_seed(seed ^ 0x6A7D)
        grad_out = torch.randn(output_shape(fwd), generator=gen, device=device).to(shape.torch_dtype)
        return Inputs(args=(grad_out, *fwd.args), kwargs=fwd.kwargs)

    return dataclasses.replace(
        forward,
        name=name,
        entry=name,
        # Dispatched inside the forward op's backward (kernels.ops calls an accepted kernel as
        # make_inputs gives the arguments), never by model code: the attention benchmark times the
        # forward op's backward pass instead.
        op_family=f"{forward.op_family}-grad",
        signature=f"{name}(grad_out, <the inputs of {forward.signature}>) -> (dq, dk, dv[, d_rel_bias])",
        description=f"Gradients of {forward.name}.\n\n{__doc__}\n\n{forward.description}",
        timing_shapes=timing_shapes,
        tolerances=GRAD_TOLERANCES,
        make_inputs=make_inputs,
        reference=gradients_of(forward.reference),
        baselines={key: gradients_of(fn) for key, fn in forward.baselines.items()},
        shape_baselines={},
        flops=lambda shape: BACKWARD_FLOP_FACTOR * forward.flops(shape),
        bytes=lambda shape: BACKWARD_FLOP_FACTOR * forward.bytes(shape),
        template=name,
        error_scale=grad_error_scale,
        forbidden_ops=(*forward.forbidden_ops, "autograd", "grad", "backward", "vjp", "jvp"),
        # The default kernels sum per-program partials of dq (broadcast queries) and of
        # d rel_bias on the host.
        host_float_ops=("sum",),
        # What is timed is the training pair: from the forward's inputs to the gradients, the
        # forward's statistics included (a backward given the forward's saved output and
        # statistics would be "backward", as embedding_bag_backward is).
        optimizes="train",
        statistics=None,  # gradients recompute what they need
    )


GRAD_KNOBS = (
    Knob("BLOCK_M", (16, 32, 64), default=32, help="dK/dV kernel: query rows streamed per step"),
    Knob("BLOCK_N", (32, 64, 128), default=64, help="dK/dV kernel: key rows a program keeps resident"),
    Knob("num_warps", (4, 8), default=4, help="dK/dV kernel: warps per program"),
    Knob("num_stages", (1, 2, 3), default=3, help="dK/dV kernel: pipelining depth of the query loop"),
    Knob("DQ_BLOCK_M", (32, 64, 128), default=128, help="dQ kernel: query rows a program keeps resident"),
    Knob("DQ_BLOCK_N", (16, 32, 64), default=64, help="dQ kernel: key rows streamed per step"),
    Knob("DQ_num_warps", (4, 8), default=8, help="dQ kernel: warps per program"),
    Knob("DQ_num_stages", (1, 2, 3), default=2, help="dQ kernel: pipelining depth of the key loop"),
)


def _grad_constraint(knobs: dict) -> str | None:
    """The resident side keeps two fp32 accumulators of [rows, D] in registers (dk and dv; dq
    and the query tile): 128 resident rows need 8 warps, or they spill."""
    if knobs["BLOCK_N"] == 128 and knobs["num_warps"] < 8:
        return "BLOCK_N = 128 resident keys need num_warps = 8 (dk and dv accumulators spill)"
    if knobs["DQ_BLOCK_M"] == 128 and knobs["DQ_num_warps"] < 8:
        return "DQ_BLOCK_M = 128 resident queries need DQ_num_warps = 8 (the dq accumulator spills)"
    return None


def grad_template(problem: str) -> KnobTemplate:
    """An entry that runs the library's forward (the kit's, for the softmax statistics) and the
    backward under the knobs' tilings."""
    return library_template(problem, GRAD_KNOBS, _grad_constraint, BACKWARD_MODULE)


# --- the gradient ops ---------------------------------------------------------------------------


def vjp_gradients_of(reference: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """fn(grad_out, q, k, v, *args, **kwargs) -> the vjp of `reference` for q, k, v (and rel_bias
    where given): what dispatch runs where Triton cannot. torch.func.vjp, not torch.autograd
    (gradients_of): inside a custom op the autograd dispatch keys are switched off."""

    def grads(grad_out, q, k, v, *args, rel_bias=None, **kwargs) -> tuple[torch.Tensor, ...]:
        def call(q, k, v, *bias):
            return reference(q, k, v, *args, **kwargs, **({"rel_bias": bias[0]} if bias else {}))

        _, vjp = torch.func.vjp(call, q, k, v, *(() if rel_bias is None else (rel_bias,)))
        return vjp(grad_out)

    return grads


def _gradient_fake(grad_out, q, k, v, *args, rel_bias=None, **kwargs) -> list[torch.Tensor]:
    return [t.new_empty(t.shape) for t in (q, k, v, *(() if rel_bias is None else (rel_bias,)))]


def gradient_op(forward: Op, problem: Problem, *, default: str, default_from_saved: str | None = None) -> Op:
    """The op of `forward`'s gradient problem: called as the problem calls a candidate
    (grad_out, then the forward's arguments, bounds included) -> [dq, dk, dv] and d rel_bias
    where the call has a bias; bucketed as the forward's call. `default_from_saved`: the default
    kernels reading the forward's saved output and statistics (search_space.op.Op)."""
    return Op(
        name=problem.name,
        problem=problem,
        default=default,
        default_from_saved=default_from_saved,
        reference=vjp_gradients_of(Op.resolve(forward.reference or forward.problem.reference)),
        fake=_gradient_fake,
        bucket=lambda grad_out, *args, **kwargs: forward.bucket(*args, **kwargs),
        cost=None
        if forward.cost is None
        else lambda grad_out, *a, **kw: gradient_cost(forward.cost(*a, **kw)),
        bounds=forward.bounds,
        gradient_of=forward.name,
        signature=gradient_signature(forward, list[torch.Tensor]),
        doc=f"""Gradients of {forward.name}: grad_out (like its output), then its arguments ->
    [dq, dk, dv] and d rel_bias where the call has a bias. Dispatched inside {forward.name}'s
    backward; see search_space/{problem.name}.py.""",
    )
