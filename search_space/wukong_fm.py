"""wukong_fm: the factorization-machine block of a Wukong interaction layer, request-broadcast,

    out[b] = X_b (X_b^T proj),     X_b = [x_user[cand_to_request[b]]; x[b]]      ([n, d])

x [B, n_c, d] (each candidate's embeddings), proj [n, k] (n = n_u + n_c, the user's rows
first), x_user [R, n_u, d] and cand_to_request [B] (each candidate's request), or neither (the
candidate's embeddings alone) -> [B, n, k]. The rank-k form of X X^T Y: X^T proj is [d, k] per
candidate, so the n x n interaction matrix is never formed; the user's embeddings are read
from the request, never copied to each candidate. Gradients by formula (plain PyTorch), with
out = X P and P = X^T proj:  dX = dOut P^T + proj dOut^T X,  d proj = sum_b X_b X_b^T dOut_b,
and the user rows' gradients summed per request.
"""

from __future__ import annotations

import torch

from search_space.op import Backward, Op
from search_space.problem import Inputs, Problem, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

NAME = ENTRY = "wukong_fm"


def gathered(
    x: torch.Tensor, x_user: torch.Tensor | None, cand_to_request: torch.Tensor | None
) -> torch.Tensor:
    """X of every candidate, [B, n, d]: its request's user embeddings, then its own."""
    if x_user is None:
        return x
    return torch.cat([x_user[cand_to_request.long()], x], dim=1)


def reference(
    x: torch.Tensor,
    proj: torch.Tensor,
    x_user: torch.Tensor | None = None,
    cand_to_request: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch in fp32 (fp64 for fp64), cast once: X (X^T proj) on the gathered X."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = gathered(x, x_user, cand_to_request).to(acc)
    return torch.bmm(xs, torch.einsum("bnd,nk->bdk", xs, proj.to(acc))).to(x.dtype)


def replicated(x, proj, x_user=None, cand_to_request=None):
    """What eager code writes: the user's embeddings copied to every candidate, two batched
    products in the inputs' dtype."""
    xs = gathered(x, x_user, cand_to_request)
    return torch.bmm(xs, torch.einsum("bnd,nk->bdk", xs, proj))


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    p, dtype = shape.params, shape.torch_dtype
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: one set a timed call
    batch, n_user, n_cand, dim, k = p["batch"], p.get("n_user", 0), p["n_cand"], p["dim"], p["k"]
    x = torch.randn(batch, n_cand, dim, generator=gen, device=device)
    proj = torch.randn(n_user + n_cand, k, generator=gen, device=device) / (n_user + n_cand) ** 0.5
    if not n_user:
        return Inputs(args=(x.to(dtype), proj.to(dtype)))
    requests = p.get("requests", max(1, batch // 32))
    # Candidates in request order, every request at least one (a serving batch's layout).
    extra = torch.randint(0, requests, (batch - requests,), generator=gen, device=device)
    cand_to_request = torch.sort(torch.cat([torch.arange(requests, device=device), extra])).values
    index = torch.int32 if seed % 2 else torch.int64
    x_user = torch.randn(requests, n_user, dim, generator=gen, device=device)
    return Inputs(
        args=(
            x.to(dtype),
            proj.to(dtype),
            x_user.to(dtype),
            cand_to_request.to(index),
        )
    )


def _requests(shape: Shape) -> int:
    p = shape.params
    return p.get("requests", max(1, p["batch"] // 32)) if p.get("n_user", 0) else 0


def flops(shape: Shape) -> float:
    """The least the op needs: X^T proj with the user's share once per request, and X times it
    per candidate. (The default kernel forms the user's share again for every candidate: its
    roofline fraction shows what sharing it would gain.)"""
    p = shape.params
    n_user, n_cand = p.get("n_user", 0), p["n_cand"]
    first = 2.0 * (_requests(shape) * n_user + p["batch"] * n_cand) * p["dim"] * p["k"]
    return first + 2.0 * p["batch"] * (n_user + n_cand) * p["dim"] * p["k"]


def bytes_moved(shape: Shape) -> float:
    """Each candidate's and each request's embeddings read once, proj once, the output written."""
    p, elem = shape.params, shape.torch_dtype.itemsize
    n_user, n_cand = p.get("n_user", 0), p["n_cand"]
    inputs = (p["batch"] * n_cand + _requests(shape) * n_user) * p["dim"] + (n_user + n_cand) * p["k"]
    return (inputs + p["batch"] * (n_user + n_cand) * p["k"]) * elem


def bucket_of(n: int, dim: int) -> str:
    width = "d<=64" if dim <= 64 else "d<=128" if dim <= 128 else "d>128"
    count = "n<=32" if n <= 32 else "n<=64" if n <= 64 else "n>64"
    return f"{width}-{count}"


def shape_bucket(shape: Shape) -> str:
    p = shape.params
    return bucket_of(p.get("n_user", 0) + p["n_cand"], p["dim"])


_s = Shape.of


# Edge cases: no user part; a dim over several slices that is no multiple of one; n and k that
# are no power of two; one candidate per request and many.
CHECK_SHAPES = tuple(
    _s(name, dtype, **params)
    for dtype in ("fp32", "bf16")
    for name, params in (
        ("request-broadcast", {"batch": 11, "n_user": 3, "n_cand": 5, "dim": 24, "k": 6, "requests": 4}),
        ("candidates-only", {"batch": 5, "n_cand": 9, "dim": 130, "k": 20}),
        ("one-per-request", {"batch": 4, "n_user": 7, "n_cand": 2, "dim": 16, "k": 4, "requests": 4}),
    )
)

# The large model's Wukong layers: the first over 14 user and 23 candidate embeddings of 128 for
# 8192 candidates (256 requests), the next over 32 embeddings of the candidates alone; rank 24.
TIMING_SHAPES = (
    _s("wukong1-b8k-n37", "bf16", batch=8192, n_user=14, n_cand=23, dim=128, k=24, requests=256),
    _s("wukong2-b8k-n32", "bf16", batch=8192, n_cand=32, dim=128, k=24),
    _s("wukong1-b8k-n37-fp32", "fp32", batch=8192, n_user=14, n_cand=23, dim=128, k=24, requests=256),
)
INTERPRETED_TIMING_SHAPES = (_s("interp-b8", "fp32", batch=8, n_user=2, n_cand=6, dim=32, k=8, requests=2),)

# Two chained products of fp32 accumulation, rounded once to the output dtype (half an ulp:
# 2^-9 of an element in bf16; a truncating cast, as the interpreter's, a whole ulp). A kernel
# that keeps X^T proj in fp32 adds at most TF32's 2^-11 per term; one that rounds it to bf16
# before the second product adds 2^-9 of each term and may not fit. The row bound allows 2^-7
# with a floor far below. fp32 rounds nothing.
TOLERANCES = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-4, norm_rtol=1e-5, row_rtol=2**-13, row_atol=2**-20),
    "bf16": Tolerance(atol=2e-2, rtol=2e-2, norm_rtol=8e-3, row_rtol=2**-7, row_atol=2**-12),
}

TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="kernels.wukong_fm",
    entry=ENTRY,
    knobs=(
        Knob("BLOCK_D", (16, 32, 64, 128), default=64, help="embedding columns per step"),
        Knob("num_warps", (1, 2, 4, 8), default=4),
    ),
    constraint=lambda knobs: None,
)

PROBLEM = Problem(
    name=NAME,
    op_family="interaction",
    entry=ENTRY,
    signature=(
        "wukong_fm(x: Tensor[B, n_c, d], proj: Tensor[n_u + n_c, k], "
        "x_user: Tensor[R, n_u, d] | None = None, "
        "cand_to_request: int32|int64 Tensor[B] | None = None) -> Tensor[B, n_u + n_c, k]"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    tolerances=TOLERANCES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.bmm replicated": replicated},
    flops=flops,
    bytes=bytes_moved,
    bucket=shape_bucket,
    template=NAME,
    forbidden_ops=(
        "mm", "matmul", "bmm", "addmm", "baddbmm", "addbmm", "einsum", "linear", "tensordot", "dot",
        "inner", "outer", "mv", "chain_matmul",
    ),
)  # fmt: skip


def _check(x, proj, x_user=None, cand_to_request=None) -> None:
    if x.dim() != 3 or proj.dim() != 2:
        raise ValueError(
            f"x must be [B, n_c, d] and proj [n, k], got {tuple(x.shape)} and {tuple(proj.shape)}"
        )
    if (x_user is None) != (cand_to_request is None):
        raise ValueError(
            "x_user and cand_to_request come together (the user's embeddings and each candidate's request)"
        )
    n_user = 0
    if x_user is not None:
        if x_user.dim() != 3 or x_user.shape[2] != x.shape[2] or x_user.dtype != x.dtype:
            raise ValueError(
                f"x_user must be [R, n_u, {x.shape[2]}] in {x.dtype}, "
                f"got {tuple(x_user.shape)} {x_user.dtype}"
            )
        if cand_to_request.shape != (x.shape[0],) or cand_to_request.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cand_to_request must be an int32 or int64 [{x.shape[0]}] tensor")
        n_user = x_user.shape[1]
    if proj.shape[0] != n_user + x.shape[1] or proj.dtype != x.dtype:
        raise ValueError(
            f"proj must be [{n_user + x.shape[1]}, k] (the user's rows, then the candidate's) in {x.dtype}, "
            f"got {tuple(proj.shape)} {proj.dtype}"
        )


def call_cost(x, proj, x_user=None, cand_to_request=None) -> tuple[float, float]:
    batch, n_cand, dim = x.shape
    requests, n_user = (0, 0) if x_user is None else x_user.shape[:2]
    k, elem = proj.shape[1], x.element_size()
    flops_ = 2.0 * (requests * n_user + batch * n_cand) * dim * k + 2.0 * batch * (n_user + n_cand) * dim * k
    moved = (
        batch * n_cand * dim + requests * n_user * dim + proj.numel() + batch * (n_user + n_cand) * k
    ) * elem
    return flops_, float(moved)


def _save(ctx, inputs: dict, output) -> None:
    ctx.save_for_backward(inputs["x"], inputs["proj"], inputs["x_user"], inputs["cand_to_request"])


def _grads(ctx, grad_out: torch.Tensor) -> dict:
    x, proj, x_user, cand_to_request = ctx.saved_tensors
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = gathered(x, x_user, cand_to_request).to(acc)
    g, y = grad_out.to(acc), proj.to(acc)
    p = torch.einsum("bnd,nk->bdk", xs, y)  # X^T proj
    grads = {}
    if ctx.needs_grad["proj"]:
        grads["proj"] = torch.bmm(xs, torch.bmm(xs.transpose(1, 2), g)).sum(0).to(proj.dtype)
    if ctx.needs_grad["x"] or (x_user is not None and ctx.needs_grad["x_user"]):
        # dX = dOut P^T + proj (dOut^T X)
        dxs = torch.bmm(g, p.transpose(1, 2)) + torch.einsum(
            "nk,bkd->bnd", y, torch.bmm(g.transpose(1, 2), xs)
        )
        n_user = 0 if x_user is None else x_user.shape[1]
        if ctx.needs_grad["x"]:
            grads["x"] = dxs[:, n_user:].to(x.dtype)
        if x_user is not None and ctx.needs_grad["x_user"]:
            per_request = torch.zeros(x_user.shape, dtype=acc, device=x.device)
            grads["x_user"] = per_request.index_add_(0, cand_to_request.long(), dxs[:, :n_user]).to(
                x_user.dtype
            )
    return grads


OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="kernels.wukong_fm:wukong_fm",
    check=_check,
    fake=lambda x, proj, x_user=None, cand_to_request=None: x.new_empty(
        (x.shape[0], proj.shape[0], proj.shape[1])
    ),
    bucket=lambda x, proj, x_user=None, cand_to_request=None: bucket_of(proj.shape[0], x.shape[2]),
    cost=call_cost,
    backward=Backward(save=_save, grads=_grads),
    doc="""Wukong's factorization-machine block, X (X^T proj) per candidate, the user's embeddings
    read from its request.

    x [B, n_c, d], proj [n_u + n_c, k], x_user [R, n_u, d] and cand_to_request [B] (or neither)
    -> [B, n_u + n_c, k]. Differentiable in x, proj and x_user.
    """,
)
