"""Public ops of the kernel library. Model code calls these; each is a torch custom op (with a
fake implementation, so torch.compile and export trace through it) whose implementation asks
the dispatcher for the best verified kernel of the call's (arch, dtype, shape bucket)."""

from __future__ import annotations

import torch

from kernels import embedding_bag as _eb
from kernels.registry import DISPATCHER, triton_usable
from search_space.embedding_bag import dim_bucket
from search_space.embedding_bag import reference as embedding_bag_reference
from search_space.problem import DTYPES

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

DISPATCHER.register_op("embedding_bag", default=_eb.embedding_bag_forward, reference=embedding_bag_reference)


@torch.library.custom_op("recforge::embedding_bag", mutates_args=())
def _embedding_bag_op(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    per_sample_weights: torch.Tensor | None,
) -> torch.Tensor:
    impl = DISPATCHER.resolve(
        "embedding_bag",
        device=weight.device,
        dtype=_DTYPE_NAMES.get(weight.dtype, str(weight.dtype)),
        bucket=dim_bucket(weight.shape[1]),
    )
    return impl.fn(weight, indices, offsets, mode=mode, per_sample_weights=per_sample_weights)


@_embedding_bag_op.register_fake
def _(weight, indices, offsets, mode, per_sample_weights):
    return weight.new_empty((offsets.shape[0] - 1, weight.shape[1]))


@torch.library.custom_op("recforge::embedding_bag_backward", mutates_args=())
def _embedding_bag_backward_op(
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    num_rows: int,
    mode: str,
) -> torch.Tensor:
    if triton_usable(grad_out.device):
        return _eb.embedding_bag_backward(
            grad_out, indices, offsets, num_rows, mode=mode, per_sample_weights=per_sample_weights
        )
    # No Triton here (CPU without the interpreter): the same math in PyTorch.
    lengths = offsets[1:] - offsets[:-1]
    bag_of_index = torch.repeat_interleave(torch.arange(lengths.numel(), device=grad_out.device), lengths)
    upd = grad_out.float()[bag_of_index]
    if mode == "mean":
        upd = upd / lengths.clamp(min=1)[bag_of_index, None]
    if per_sample_weights is not None:
        upd = upd * per_sample_weights.float()[:, None]
    grad_weight = torch.zeros(num_rows, grad_out.shape[1], device=grad_out.device)
    return grad_weight.index_add_(0, indices, upd).to(grad_out.dtype)


@_embedding_bag_backward_op.register_fake
def _(grad_out, indices, offsets, per_sample_weights, num_rows, mode):
    return grad_out.new_empty((num_rows, grad_out.shape[1]))


def _setup_context(ctx, inputs, output):
    weight, indices, offsets, mode, per_sample_weights = inputs
    ctx.save_for_backward(weight, indices, offsets, per_sample_weights)
    ctx.mode = mode


def _backward(ctx, grad_out):
    weight, indices, offsets, per_sample_weights = ctx.saved_tensors
    grad_weight = grad_psw = None
    if ctx.needs_input_grad[0]:
        grad_weight = torch.ops.recforge.embedding_bag_backward(
            grad_out, indices, offsets, per_sample_weights, weight.shape[0], ctx.mode
        )
    if ctx.needs_input_grad[4]:
        lengths = offsets[1:] - offsets[:-1]
        bag_of_index = torch.repeat_interleave(torch.arange(lengths.numel(), device=weight.device), lengths)
        grad_psw = (grad_out.float()[bag_of_index] * weight.float()[indices]).sum(-1)
        grad_psw = grad_psw.to(per_sample_weights.dtype)
    return grad_weight, None, None, None, grad_psw


torch.library.register_autograd("recforge::embedding_bag", _backward, setup_context=_setup_context)


def embedding_bag(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    *,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pooled embedding-bag lookup.

    weight [num_rows, D]; indices [nnz] int32/int64; offsets [B + 1] (bag b is
    indices[offsets[b]:offsets[b+1]]); per_sample_weights [nnz] (mode 'sum' only) -> [B, D].
    Differentiable in weight and per_sample_weights.
    """
    _eb._check(weight, indices, offsets, mode, per_sample_weights)
    return _embedding_bag_op(weight, indices, offsets, mode, per_sample_weights)
