"""The test suite's own op, declared through the op API alone (search_space.op.Op, a Problem and
a knob template): a jagged per-sequence scaled sum,

    out[b, :] = scale * sum_{i in [offsets[b], offsets[b + 1])} x[i, :]

Nothing outside this file and its kernel (seq_scaled_sum_kernel.py) knows of it: RECFORGE_OPS
names this module, and the sandbox, campaigns, dispatch and benchmarks find it there
(tests/ops/test_plugin_op.py).
"""

from __future__ import annotations

import torch

from search_space.op import Backward, Op
from search_space.problem import Inputs, Problem, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

NAME = ENTRY = "seq_scaled_sum"


def reference(x: torch.Tensor, offsets: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """Plain PyTorch in fp32 (fp64 if given fp64), returned in x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    lengths = offsets[1:] - offsets[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths)
    out = torch.zeros(lengths.numel(), x.shape[1], dtype=acc, device=x.device)
    return (out.index_add_(0, seq_of_row, x.to(acc)) * scale).to(x.dtype)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    p = shape.params
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lengths = (
        torch.tensor(p["lengths"])
        if "lengths" in p
        else torch.randint(0, p["max_len"] + 1, (p["num_seqs"],), generator=gen)
    )
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    x = torch.randn(int(offsets[-1]), p["dim"], generator=gen).to(shape.torch_dtype)
    return Inputs(args=(x.to(device), offsets.to(device)), kwargs={"scale": p.get("scale", 0.5)})


def _rows(shape: Shape) -> float:
    p = shape.params
    return sum(p["lengths"]) if "lengths" in p else p["num_seqs"] * p["max_len"] / 2


def _num_seqs(shape: Shape) -> int:
    return len(shape.params["lengths"]) if "lengths" in shape.params else shape.params["num_seqs"]


def dim_bucket(dim: int) -> str:
    return "d<=64" if dim <= 64 else "d>64"


def _s(name: str, dtype: str, **params) -> Shape:
    return Shape(name=name, dtype=dtype, params=params)


PROBLEM = Problem(
    name=NAME,
    op_family="jagged",
    entry=ENTRY,
    signature=(
        "seq_scaled_sum(x: Tensor[total, D], offsets: int64 Tensor[B + 1], *, scale: float = 1.0) "
        "-> Tensor[B, D]"
    ),
    description=__doc__,
    check_shapes=tuple(
        _s(name, dtype, **params)
        for dtype in ("fp32", "bf16")
        for name, params in (
            ("with-empty", {"dim": 48, "lengths": [3, 0, 17, 1, 0, 40]}),
            ("one-long", {"dim": 16, "lengths": [70], "scale": 2.0}),
            ("wide", {"dim": 100, "num_seqs": 9, "max_len": 20}),
        )
    ),
    timing_shapes=(
        _s("b16k-d128", "bf16", dim=128, num_seqs=16_384, max_len=256),
        _s("b16k-d64", "fp32", dim=64, num_seqs=16_384, max_len=256),
    ),
    interpreted_timing_shapes=(_s("interp-b8-d32", "fp32", dim=32, num_seqs=8, max_len=16),),
    # Each output row is one sequence's sum, accumulated in fp32 by kernel and reference alike and
    # cast once to the output dtype. The reference rounds to nearest; a cast may truncate (the
    # interpreter's does), so the two differ by at most one ulp per element: 2^-7 of the row's
    # norm in bf16. A zeroed or coarsely rounded row is far outside that.
    tolerances={
        "fp32": Tolerance(atol=1e-5, rtol=1e-5, norm_rtol=1e-5, row_rtol=1e-5, row_atol=1e-7),
        "bf16": Tolerance(atol=1.6e-2, rtol=1.6e-2, norm_rtol=8e-3, row_rtol=2**-7, row_atol=2**-12),
    },
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.index_add": reference},
    flops=lambda shape: _rows(shape) * shape.params["dim"],
    bytes=lambda shape: (_rows(shape) + _num_seqs(shape)) * shape.params["dim"] * shape.torch_dtype.itemsize,
    bucket=lambda shape: dim_bucket(shape.params["dim"]),
    template=NAME,
    forbidden_ops=("index_add", "index_add_", "segment_reduce", "scatter_add", "scatter_add_", "cumsum"),
)

TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="seq_scaled_sum_kernel",
    entry=ENTRY,
    knobs=(
        Knob("BLOCK_L", (8, 16, 32), default=16, help="rows added per step"),
        Knob("BLOCK_D", (32, 64, 128), default=64, help="columns per program"),
        Knob("num_warps", (2, 4), default=4),
    ),
    constraint=lambda knobs: None,
)


def _check(x, offsets, *, scale=1.0) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [total, D] tensor, got shape {tuple(x.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError("offsets must be an int32 or int64 [B + 1] tensor")


def _save(ctx, inputs: dict, output) -> None:
    ctx.save_for_backward(inputs["offsets"])
    ctx.scale, ctx.total = inputs["scale"], inputs["x"].shape[0]


def _grads(ctx, grad_out: torch.Tensor) -> dict:
    (offsets,) = ctx.saved_tensors
    lengths = offsets[1:] - offsets[:-1]
    seq_of_row = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=grad_out.device), lengths, output_size=ctx.total
    )
    return {"x": grad_out[seq_of_row] * ctx.scale}


OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="seq_scaled_sum_kernel:seq_scaled_sum",
    check=_check,
    fake=lambda x, offsets, *, scale=1.0: x.new_empty((offsets.shape[0] - 1, x.shape[1])),
    bucket=lambda x, offsets, *, scale=1.0: dim_bucket(x.shape[1]),
    backward=Backward(save=_save, grads=_grads),
    doc="scale times the sum of each sequence's rows: x [total, D], offsets [B + 1] -> [B, D].",
)
