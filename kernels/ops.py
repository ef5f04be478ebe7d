"""Public ops of the kernel library. Model code calls these; each is a torch custom op (with a
fake implementation, so torch.compile and export trace through it) whose implementation asks
the dispatcher for the best verified kernel of the call's (arch, dtype, shape bucket). The
attention ops' backwards ask it too, for the op's gradients (`<op>_grad`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from kernels import attention as _attn
from kernels.opdef import _DTYPE_NAMES, _EagerOp, define, defined, public
from kernels.registry import DISPATCHER, Implementation
from search_space import embedding_bag as _eb_problem
from search_space import embedding_bag_backward as _ebb_problem
from search_space.attention import gdpa_reference, jagged_attention_reference, target_attention_reference
from search_space.attention_common import bucket_of as attention_bucket
from search_space.op import get_op

# --- ops declared once (search_space.op.Op; kernels.opdef.define) ---------------------------

embedding_bag = define(_eb_problem.OP)
embedding_bag_backward = define(_ebb_problem.OP)


def op(name: str) -> Callable:
    """The public function of op `name`: one of this module's, or a plug-in's (declared in a
    module RECFORGE_OPS names; see search_space.problem), defined on first use."""
    if name in defined():
        return public(name)
    return define(get_op(name))


def __getattr__(name: str) -> Callable:
    """`kernels.ops.<name>` for every op declared in search_space/<name>.py (its OP), defined on
    first use: a new op is its own files, with no line here."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return op(name)
    except ValueError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (no op of that name)") from None


# --- attention family ---------------------------------------------------------------------------
#
# Each op is a forward custom op and a backward custom op, both dispatched (library kernel,
# default kernel or reference): the forward as `<op>`, the backward as `<op>_grad`, the op's
# gradient problem (search_space/<op>_grad.py). A library kernel of the gradients is called as
# that problem calls it, fn(grad_out, *forward args, **forward kwargs) -> (dq, dk, dv) plus
# d rel_bias where the call has a bias, and recomputes whatever forward statistics it needs; the
# default backward reads the ones the forward saved instead. The softmax forwards also return
# the row statistics (lse) the default backward reads; when no gradient will be taken, or for
# silu, that second output is empty. A library forward returns them itself when asked
# (return_lse=True, the forward problems' contract: search_space.attention_common.SOFTMAX_LSE),
# so training runs one forward whichever kernel computes it.

DISPATCHER.register_op(
    "jagged_attention", default=_attn.jagged_attention_forward, reference=jagged_attention_reference
)
DISPATCHER.register_op("gdpa", default=_attn.gdpa_forward, reference=gdpa_reference)
DISPATCHER.register_op(
    "target_attention", default=_attn.target_attention_forward, reference=target_attention_reference
)


def _resolve_attention(
    op: str, q: torch.Tensor, max_len: int | None, offsets: torch.Tensor, graph: str = "train"
) -> Implementation:
    """The implementation for the call's bucket (search_space.attention_common.bucket_of), by its
    longest sequence of keys: the bound where the caller gave one, else read from `offsets`
    (a host sync, as the kernels make without bounds). `graph`: "train" for gradients and for a
    forward that saves statistics for its backward, "serve" for a forward that does not."""
    if max_len is None:
        max_len = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    bucket = attention_bucket(q.shape[-1], max_len)
    return DISPATCHER.resolve(
        op, device=q.device, dtype=_DTYPE_NAMES.get(q.dtype, str(q.dtype)), bucket=bucket, graph=graph
    )


def _bounds_for(impl: Implementation, **bounds) -> dict:
    """The call's launch bounds, which spare a kernel its host sync and keep the op capturable
    in a CUDA graph: part of every implementation's arguments (the problems pass them too),
    except a library entry registered before they were, whose function does not name them."""
    return bounds if _takes(impl.fn, tuple(bounds)) else {}


@functools.lru_cache(maxsize=512)
def _takes(fn: Callable, names: tuple[str, ...]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: called as the problem calls it
        return True
    return all(n in parameters for n in names) or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _forward_with_lse(
    impl: Implementation,
    default: Callable,
    args: tuple,
    kwargs: dict,
    lse_shape: tuple[int, int] | None,
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the resolved forward; lse only when lse_shape says the backward needs it."""
    if lse_shape is None:
        return impl.fn(*args, **kwargs), like.new_empty(0, dtype=torch.float32)
    if impl.name == "default":
        return default(*args, **kwargs, return_lse=True)
    if impl.name == "reference":
        # Without Triton the backward differentiates the reference and never reads lse.
        return impl.fn(*args, **kwargs), like.new_zeros(lse_shape, dtype=torch.float32)
    if _takes(impl.fn, ("return_lse",)):
        # The forward problems' contract: the sandbox checked these statistics with the output.
        got = impl.fn(*args, **kwargs, return_lse=True)
        lse = got[1] if isinstance(got, tuple | list) and len(got) == 2 else None
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != lse_shape or lse.dtype != torch.float32:
            what = (
                f"lse {tuple(lse.shape)} {lse.dtype}" if isinstance(lse, torch.Tensor) else type(got).__name__
            )
            raise RuntimeError(
                f"library kernel {impl.name!r} given return_lse=True returned {what}, expected "
                f"(out, lse {lse_shape} torch.float32)"
            )
        return got[0], lse
    # An entry registered before the contract returned statistics computes the output alone;
    # they come from one default forward.
    return impl.fn(*args, **kwargs), default(*args, **kwargs, return_lse=True)[1]


def _graph(lse_shape: tuple[int, int] | None) -> str:
    """The graph a softmax forward's call belongs to for dispatch: "train" where it saves the
    statistics for a backward (the form whose speed decides whether an entry serves training),
    "serve" otherwise (silu saves none: its training call is its serving call)."""
    return "serve" if lse_shape is None else "train"


def _needs_lse(activation: str, *inputs: torch.Tensor | None) -> bool:
    return (
        activation == "softmax"
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in inputs)
    )


def _reference_grads(
    reference: Callable[..., torch.Tensor], grad_out: torch.Tensor, *inputs: torch.Tensor | None
) -> list[torch.Tensor | None]:
    """Gradients of `reference(*inputs)`: the backward where Triton cannot run. torch.func.vjp,
    not torch.autograd: inside a custom op the autograd dispatch keys are switched off."""
    present = [i for i, t in enumerate(inputs) if t is not None]

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        full = list(inputs)
        for i, t in zip(present, tensors, strict=True):
            full[i] = t
        return reference(*full)

    _, vjp = torch.func.vjp(call, *(inputs[i] for i in present))
    grads = dict(zip(present, vjp(grad_out), strict=True))
    return [grads.get(i) for i in range(len(inputs))]


def _default_grad(forward: Callable, backward: Callable) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The default kernels in a gradient problem's convention: fn(grad_out, *args, **kwargs) runs
    `forward` for the statistics `backward` reads, then `backward` -> (dq, dk, dv), and d rel_bias
    where kwargs has a bias."""

    def grads(grad_out: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        out, lse = forward(*args, return_lse=True, **kwargs)
        dq, dk, dv, *d_rel_bias = backward(grad_out, *args, out, lse, **kwargs)
        return (dq, dk, dv, *d_rel_bias) if kwargs.get("rel_bias") is not None else (dq, dk, dv)

    return grads


def _reference_grad(reference: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The vjp of `reference` in a gradient problem's convention: fn(grad_out, q, k, v, *args,
    **kwargs) -> (dq, dk, dv), and d rel_bias where kwargs has a bias."""

    def grads(grad_out: torch.Tensor, q, k, v, *args, rel_bias=None, **kwargs) -> tuple[torch.Tensor, ...]:
        def call(q, k, v, rel_bias):
            bias = {} if rel_bias is None else {"rel_bias": rel_bias}
            return reference(q, k, v, *args, **kwargs, **bias)

        dq, dk, dv, d_rel_bias = _reference_grads(call, grad_out, q, k, v, rel_bias)
        return (dq, dk, dv) if rel_bias is None else (dq, dk, dv, d_rel_bias)

    return grads


DISPATCHER.register_op(
    "jagged_attention_grad",
    default=_default_grad(_attn.jagged_attention_forward, _attn.jagged_attention_backward),
    reference=_reference_grad(jagged_attention_reference),
    gradient_of="jagged_attention",
)
# Pointwise attention has no forward statistics to read: gdpa_backward takes the problem's arguments.
DISPATCHER.register_op(
    "gdpa_grad", default=_attn.gdpa_backward, reference=_reference_grad(gdpa_reference), gradient_of="gdpa"
)
DISPATCHER.register_op(
    "target_attention_grad",
    default=_default_grad(_attn.target_attention_forward, _attn.target_attention_backward),
    reference=_reference_grad(target_attention_reference),
    gradient_of="target_attention",
)


# jagged_attention ------------------------------------------------------------------------------


def _jagged_attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    activation: str,
    causal: bool,
    num_targets: torch.Tensor | None,
    rel_bias: torch.Tensor | None,
    scale: float,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    kwargs = dict(
        max_seq_len=max_seq_len,
        activation=activation,
        causal=causal,
        num_targets=num_targets,
        rel_bias=rel_bias,
        scale=scale,
    )
    lse_shape = (q.shape[1], q.shape[0]) if need_lse and activation == "softmax" else None
    impl = _resolve_attention("jagged_attention", q, max_seq_len, offsets, _graph(lse_shape))
    return _forward_with_lse(impl, _attn.jagged_attention_forward, (q, k, v, offsets), kwargs, lse_shape, q)


_jagged_attention_op = torch.library.custom_op("recforge::jagged_attention", mutates_args=())(
    _jagged_attention_impl
)


@_jagged_attention_op.register_fake
def _(q, k, v, offsets, max_seq_len, activation, causal, num_targets, rel_bias, scale, need_lse):
    lse_shape = (q.shape[1], q.shape[0]) if need_lse and activation == "softmax" else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _jagged_attention_backward_impl(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    max_seq_len: int,
    activation: str,
    causal: bool,
    num_targets: torch.Tensor | None,
    rel_bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    kwargs = dict(
        max_seq_len=max_seq_len, activation=activation, causal=causal, num_targets=num_targets, scale=scale
    )
    impl = _resolve_attention("jagged_attention_grad", q, max_seq_len, offsets)
    if impl.name == "default":
        dq, dk, dv, d_rel_bias = _attn.jagged_attention_backward(
            grad_out, q, k, v, offsets, out, lse, rel_bias=rel_bias, **kwargs
        )
    else:
        grads = impl.fn(grad_out, q, k, v, offsets, rel_bias=rel_bias, **kwargs)
        dq, dk, dv = grads[:3]
        d_rel_bias = grads[3] if rel_bias is not None else None
    return dq, dk, dv, d_rel_bias if d_rel_bias is not None else q.new_empty(0, dtype=torch.float32)


_jagged_attention_backward_op = torch.library.custom_op(
    "recforge::jagged_attention_backward", mutates_args=()
)(_jagged_attention_backward_impl)


@_jagged_attention_backward_op.register_fake
def _(grad_out, q, k, v, offsets, out, lse, max_seq_len, activation, causal, num_targets, rel_bias, scale):
    d_rel_bias = (
        rel_bias.new_empty(rel_bias.shape) if rel_bias is not None else q.new_empty(0, dtype=torch.float32)
    )
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_rel_bias


def _jagged_attention_setup_context(ctx, inputs, output):
    q, k, v, offsets, max_seq_len, activation, causal, num_targets, rel_bias, scale, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, offsets, num_targets, rel_bias, out, lse)
    ctx.attrs = (max_seq_len, activation, causal, scale)


def _jagged_attention_backward(ctx, grad_out, _grad_lse):
    q, k, v, offsets, num_targets, rel_bias, out, lse = ctx.saved_tensors
    max_seq_len, activation, causal, scale = ctx.attrs
    dq, dk, dv, d_rel_bias = _jagged_attention_backward_call(
        grad_out, q, k, v, offsets, out, lse, max_seq_len, activation, causal, num_targets, rel_bias, scale
    )
    d_rel_bias = d_rel_bias if rel_bias is not None else None
    return dq, dk, dv, None, None, None, None, None, d_rel_bias, None, None


torch.library.register_autograd(
    "recforge::jagged_attention", _jagged_attention_backward, setup_context=_jagged_attention_setup_context
)
_jagged_attention_call = _EagerOp(
    _jagged_attention_op, _jagged_attention_impl, _jagged_attention_setup_context, _jagged_attention_backward
)
_jagged_attention_backward_call = _EagerOp(_jagged_attention_backward_op, _jagged_attention_backward_impl)


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_seq_len: int,
    activation: str = "softmax",
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    rel_bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Self-attention over jagged sequences (HSTU encoder; search_space.attention has the math).

    q, k, v [total_tokens, H, D] (bf16, fp16 or fp32; D a power of two, 16 to 256); offsets
    [B + 1] int32/int64 from 0 to total_tokens; max_seq_len >= every sequence length (it sizes
    the launch, so it is not checked: that would sync the host; silu divides by it);
    activation 'softmax' or 'silu'; num_targets [B]: the last num_targets[b] tokens of sequence
    b are candidates that see the history and themselves only; rel_bias [H, num_buckets] fp32
    relative-position bias; scale defaults to D ** -0.5 -> out [total_tokens, H, D].
    Differentiable in q, k, v and rel_bias.
    """
    _attn.check_jagged_attention(
        q,
        k,
        v,
        offsets,
        max_seq_len=max_seq_len,
        activation=activation,
        num_targets=num_targets,
        rel_bias=rel_bias,
    )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    need_lse = _needs_lse(activation, q, k, v, rel_bias)
    out, _ = _jagged_attention_call(
        q, k, v, offsets, max_seq_len, activation, causal, num_targets, rel_bias, scale, need_lse
    )
    return out


# gdpa ------------------------------------------------------------------------------------------


def _gdpa_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    activation: str,
    scale: float,
    broadcast_q: bool,
    max_q_len: int | None,
    max_kv_len: int | None,
) -> torch.Tensor:
    impl = _resolve_attention("gdpa", q, max_kv_len, kv_offsets, "serve")  # no statistics: one form
    bounds = _bounds_for(impl, max_q_len=max_q_len, max_kv_len=max_kv_len)
    return impl.fn(
        q, k, v, q_offsets, kv_offsets, activation=activation, scale=scale, broadcast_q=broadcast_q, **bounds
    )


_gdpa_op = torch.library.custom_op("recforge::gdpa", mutates_args=())(_gdpa_impl)


@_gdpa_op.register_fake
def _(q, k, v, q_offsets, kv_offsets, activation, scale, broadcast_q, max_q_len, max_kv_len):
    rows = (kv_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
    return q.new_empty((rows, q.shape[1], q.shape[2]))


def _gdpa_backward_impl(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    activation: str,
    scale: float,
    broadcast_q: bool,
    max_q_len: int | None,
    max_kv_len: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The default (gdpa_backward) needs no forward statistics: every implementation is called alike.
    impl = _resolve_attention("gdpa_grad", q, max_kv_len, kv_offsets)
    bounds = _bounds_for(impl, max_q_len=max_q_len, max_kv_len=max_kv_len)
    dq, dk, dv = impl.fn(
        grad_out, q, k, v, q_offsets, kv_offsets, activation=activation, scale=scale,
        broadcast_q=broadcast_q, **bounds,
    )  # fmt: skip
    return dq, dk, dv


_gdpa_backward_op = torch.library.custom_op("recforge::gdpa_backward", mutates_args=())(_gdpa_backward_impl)


@_gdpa_backward_op.register_fake
def _(grad_out, q, k, v, q_offsets, kv_offsets, activation, scale, broadcast_q, *bounds):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _gdpa_setup_context(ctx, inputs, output):
    q, k, v, q_offsets, kv_offsets, *attrs = inputs
    ctx.save_for_backward(q, k, v, q_offsets, kv_offsets)
    ctx.attrs = attrs  # activation, scale, broadcast_q, max_q_len, max_kv_len


def _gdpa_backward(ctx, grad_out):
    q, k, v, q_offsets, kv_offsets = ctx.saved_tensors
    dq, dk, dv = _gdpa_backward_call(grad_out, q, k, v, q_offsets, kv_offsets, *ctx.attrs)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("recforge::gdpa", _gdpa_backward, setup_context=_gdpa_setup_context)
_gdpa_call = _EagerOp(_gdpa_op, _gdpa_impl, _gdpa_setup_context, _gdpa_backward)
_gdpa_backward_call = _EagerOp(_gdpa_backward_op, _gdpa_backward_impl)


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    *,
    activation: str = "gelu",
    scale: float | None = None,
    broadcast_q: bool = False,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
) -> torch.Tensor:
    """Generalized dot-product attention: out_i = sum_j act(scale q_i . k_j) v_j over the keys of
    query i's sequence (non-causal, no normalisation).

    q [total_q, H, D] with q_offsets [B + 1], or with broadcast_q learned seeds [n_q, H, D]
    shared by all samples (q_offsets ignored); k, v [total_kv, H, D] with kv_offsets [B + 1];
    activation 'gelu' (erf), 'silu', 'relu' or 'none' -> out [total_q, H, D] ([B * n_q, H, D]
    with broadcast_q). Differentiable in q, k and v.

    The Triton path syncs the host once per forward and once per backward (checking the offsets;
    the longest sequences size the launch). Given max_kv_len (>= every key sequence) and, unless
    broadcast_q, max_q_len (>= every query sequence), the default kernels sync never and check
    nothing on the device (the bounds are trusted), so the call can be captured in a CUDA graph.
    """
    _attn.check_gdpa(
        q, k, v, q_offsets, kv_offsets, activation=activation, broadcast_q=broadcast_q,
        max_q_len=max_q_len, max_kv_len=max_kv_len,
    )  # fmt: skip
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _gdpa_call(
        q, k, v, None if broadcast_q else q_offsets, kv_offsets, activation, scale, broadcast_q,
        max_q_len, max_kv_len,
    )  # fmt: skip


# target_attention ------------------------------------------------------------------------------


def _target_attention_impl(
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    activation: str,
    scale: float,
    need_lse: bool,
    max_candidates: int | None,
    max_history: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_cand, seeds, num_heads, _ = q_cand.shape
    lse_shape = (num_heads, num_cand * seeds) if need_lse and activation == "softmax" else None
    impl = _resolve_attention("target_attention", q_cand, max_history, kv_offsets, _graph(lse_shape))
    args = (q_cand, k, v, kv_offsets, cand_to_request)
    kwargs = dict(activation=activation, scale=scale)
    kwargs |= _bounds_for(impl, max_candidates=max_candidates, max_history=max_history)
    return _forward_with_lse(impl, _attn.target_attention_forward, args, kwargs, lse_shape, q_cand)


_target_attention_op = torch.library.custom_op("recforge::target_attention", mutates_args=())(
    _target_attention_impl
)


@_target_attention_op.register_fake
def _(q_cand, k, v, kv_offsets, cand_to_request, activation, scale, need_lse, max_candidates, max_history):
    num_cand, seeds, num_heads, _ = q_cand.shape
    lse_shape = (num_heads, num_cand * seeds) if need_lse and activation == "softmax" else (0,)
    return q_cand.new_empty(q_cand.shape), q_cand.new_empty(lse_shape, dtype=torch.float32)


def _target_attention_backward_impl(
    grad_out: torch.Tensor,
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    activation: str,
    scale: float,
    max_candidates: int | None,
    max_history: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = _resolve_attention("target_attention_grad", q_cand, max_history, kv_offsets)
    if impl.name == "default":
        return _attn.target_attention_backward(
            grad_out, q_cand, k, v, kv_offsets, cand_to_request, out, lse, activation=activation,
            scale=scale, max_candidates=max_candidates, max_history=max_history,
        )  # fmt: skip
    bounds = _bounds_for(impl, max_candidates=max_candidates, max_history=max_history)
    dq, dk, dv = impl.fn(
        grad_out, q_cand, k, v, kv_offsets, cand_to_request, activation=activation, scale=scale, **bounds
    )
    return dq, dk, dv


_target_attention_backward_op = torch.library.custom_op(
    "recforge::target_attention_backward", mutates_args=()
)(_target_attention_backward_impl)


@_target_attention_backward_op.register_fake
def _(grad_out, q_cand, k, v, kv_offsets, cand_to_request, out, lse, activation, scale, *bounds):
    return q_cand.new_empty(q_cand.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _target_attention_setup_context(ctx, inputs, output):
    q_cand, k, v, kv_offsets, cand_to_request, activation, scale, _, max_candidates, max_history = inputs
    out, lse = output
    ctx.save_for_backward(q_cand, k, v, kv_offsets, cand_to_request, out, lse)
    ctx.attrs = (activation, scale, max_candidates, max_history)


def _target_attention_backward(ctx, grad_out, _grad_lse):
    q_cand, k, v, kv_offsets, cand_to_request, out, lse = ctx.saved_tensors
    dq, dk, dv = _target_attention_backward_call(
        grad_out, q_cand, k, v, kv_offsets, cand_to_request, out, lse, *ctx.attrs
    )
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd(
    "recforge::target_attention", _target_attention_backward, setup_context=_target_attention_setup_context
)
_target_attention_call = _EagerOp(
    _target_attention_op, _target_attention_impl, _target_attention_setup_context, _target_attention_backward
)
_target_attention_backward_call = _EagerOp(_target_attention_backward_op, _target_attention_backward_impl)


def target_attention(
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    max_candidates: int | None = None,
    max_history: int | None = None,
) -> torch.Tensor:
    """Request-broadcast target attention: every seed of candidate c attends to the history of
    request cand_to_request[c], which is never copied per candidate.

    q_cand [C, S, H, D]; k, v [total_kv, H, D] with kv_offsets [R + 1] (request r's history is
    rows kv_offsets[r]:kv_offsets[r + 1]); cand_to_request [C] in [0, R), in any order;
    activation 'softmax' or 'silu' (unnormalised) -> out [C, S, H, D]; an empty history gives
    zeros. Differentiable in q_cand, k and v.

    The Triton path syncs the host once per forward and once per backward (checking the inputs,
    grouping the candidates by request and sizing the launch). Given max_candidates (>= the
    candidates of any one request) and max_history (>= every history length), the default
    kernels sync never and check nothing on the device (like jagged_attention's max_seq_len,
    the bounds are trusted), so the call can be captured in a CUDA graph.
    """
    _attn.check_target_attention(
        q_cand, k, v, kv_offsets, cand_to_request, activation=activation,
        max_candidates=max_candidates, max_history=max_history,
    )  # fmt: skip
    scale = q_cand.shape[-1] ** -0.5 if scale is None else float(scale)
    need_lse = _needs_lse(activation, q_cand, k, v)
    out, _ = _target_attention_call(
        q_cand, k, v, kv_offsets, cand_to_request, activation, scale, need_lse, max_candidates, max_history
    )
    return out
