"""The default kernels of layer_norm_gate (search_space/layer_norm_gate.py) and of its gradients
(search_space/layer_norm_gate_grad.py):

    forward:   out = (xhat * w + b) * u,   xhat = (x - mean) * rstd,   rstd = 1 / sqrt(var + eps)
    backward:  du = g * y (y = xhat * w + b),   dy = g * u,   dw = sum_rows dy * xhat,
               db = sum_rows dy,   dx = rstd * (dy w - mean(dy w) - xhat * mean(dy w xhat))

per row of x [T, I], in fp32, each output rounded once. A program holds BLOCK_T whole rows (D = I
columns, padded to BLOCK_D, a power of two), so the statistics never leave registers: one read
of x, u (and grad_out), one write of each output.

The statistics are taken about the row's first element: its mean is that element plus the mean
of the differences, and the variance is the mean square of the centred differences (two passes
over registers). A row of one value then has differences of exactly 0, so its normalized values
are exactly 0 (a mean rounded an ulp off would be multiplied by 1 / sqrt(eps), 316 at 1e-5), and
the variance of a row far from zero is taken on differences of its own scale, with no
E[x^2] - E[x]^2 cancellation.

The backward recomputes the statistics from x, which it reads anyway, so the forward saves
nothing but its arguments. The weight and bias gradients are sums over every row: each program
walks `steps` blocks of rows, keeps its sums in fp32 registers and writes one row of per-program
partial sums, which a second small kernel adds up (in a fixed order: the same gradients every
run, no atomics and no zero-filled buffer). About a thousand programs on a GPU leave a few MB of
partials at the model's 250k rows, against the GB the gradients move.

This module is also the knob template of both problems (the GRAD_ knobs are the gradients'):
a search writes values into KNOBS; None keeps the launch heuristic (_forward_config,
_backward_config), which is what the default kernels run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KNOBS = {
    "BLOCK_T": None,
    "num_warps": None,
    "GRAD_BLOCK_T": None,
    "GRAD_num_warps": None,
    "GRAD_PROGRAMS": None,
}


@triton.jit
def _normalized(x, x0, mask, D, eps):
    """(xhat, rstd) of the rows of x [BLOCK_T, BLOCK_D] (fp32, zeros where masked), their first
    elements x0 [BLOCK_T]: statistics about the first element, so a constant row is exact."""
    diff = tl.where(mask, x - x0[:, None], 0.0)
    shift = tl.sum(diff, axis=1) / D
    centred = tl.where(mask, diff - shift[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / D + eps)
    return centred * rstd[:, None], rstd


@triton.jit
def _forward_kernel(
    x_ptr, u_ptr, w_ptr, b_ptr, out_ptr,
    T, D, stride_x, stride_u, stride_o, eps,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < T
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(x_ptr + rows * stride_x, mask=row_ok, other=0.0).to(tl.float32)
    xhat, _ = _normalized(x, x0, mask, D, eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = (xhat * w[None, :] + b[None, :]) * u
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    g_ptr, x_ptr, u_ptr, w_ptr, b_ptr, dx_ptr, du_ptr, dw_part_ptr, db_part_ptr,
    T, D, steps, stride_g, stride_x, stride_u, stride_dx, stride_du, eps,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    first = program * steps * BLOCK_T
    for step in range(0, steps):
        rows = first + step * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x0 = tl.load(x_ptr + rows * stride_x, mask=row_ok, other=0.0).to(tl.float32)
        xhat, rstd = _normalized(x, x0, mask, D, eps)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        du = g * (xhat * w[None, :] + b[None, :])
        tl.store(
            du_ptr + rows[:, None] * stride_du + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask
        )
        dy = g * u  # zero in masked rows and columns (g is)
        dw_acc += dy * xhat
        db_acc += dy
        dyw = dy * w[None, :]
        mean_dyw = tl.sum(dyw, axis=1) / D
        mean_dyw_xhat = tl.sum(dyw * xhat, axis=1) / D
        dx = (dyw - mean_dyw[:, None] - xhat * mean_dyw_xhat[:, None]) * rstd[:, None]
        tl.store(
            dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask
        )
    tl.store(dw_part_ptr + program * D + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    tl.store(db_part_ptr + program * D + cols, tl.sum(db_acc, axis=0), mask=col_ok)


@triton.jit
def _sum_partials_kernel(
    dw_part_ptr, db_part_ptr, dw_ptr, db_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < D
    dw = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    db = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        mask = (parts < P)[:, None] & col_ok[None, :]
        at = parts.to(tl.int64)[:, None] * D + cols[None, :]
        dw += tl.load(dw_part_ptr + at, mask=mask, other=0.0)
        db += tl.load(db_part_ptr + at, mask=mask, other=0.0)
    tl.store(dw_ptr + cols, tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty), mask=col_ok)
    tl.store(db_ptr + cols, tl.sum(db, axis=0).to(db_ptr.dtype.element_ty), mask=col_ok)


def _forward_config(block_d: int, interpreted: bool) -> dict:
    """Launch parameters of the forward. On a GPU (untuned: not yet measured): about 4096
    elements a program, 16 a thread in 8 warps (8 rows of 512 columns), at most 16 rows.
    Interpreted (CPU tensors), each op of a program is one NumPy call whatever its tile: few
    wide programs, up to 64 rows."""
    if interpreted:
        return {"BLOCK_T": max(1, min(64, 16384 // block_d)), "num_warps": 4}
    block_t = max(1, min(16, 4096 // block_d))
    return {"BLOCK_T": block_t, "num_warps": 4 if block_t * block_d <= 2048 else 8}


def _backward_config(block_d: int, interpreted: bool) -> dict:
    """Launch parameters of the gradients. On a GPU (untuned: not yet measured): about 2048
    elements a step (4 rows of 512 columns), 16 a thread in 4 warps, whose five row tiles and two
    accumulators stay in registers; about a thousand programs, each walking its share of the
    rows. Interpreted: up to 64 rows a step and at most 64 programs (as many NumPy calls in all
    as fewer programs of more steps, and the partial sums' loop takes more than one block of
    them on the gradient problem's many-rows shape)."""
    if interpreted:
        return {"BLOCK_T": max(1, min(64, 16384 // block_d)), "num_warps": 4, "PROGRAMS": 64}
    block_t = max(1, min(16, 2048 // block_d))
    return {"BLOCK_T": block_t, "num_warps": max(1, min(8, block_t * block_d // 512)), "PROGRAMS": 1024}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit column stride (a row stride of its own is kept)."""
    return t if t.stride(1) == 1 else t.contiguous()


def layer_norm_gate(
    x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """x [T, I], u [T, I] (x's dtype), weight [I], bias [I] -> (LayerNorm(x) * weight + bias) * u
    [T, I] in x's dtype, computed in fp32."""
    total, dim = x.shape
    out = torch.empty((total, dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x, u = _rows(x), _rows(u)
    block_d = triton.next_power_of_2(dim)
    cfg = _forward_config(block_d, interpreted=x.device.type == "cpu")
    cfg = {name: value if KNOBS[name] is None else KNOBS[name] for name, value in cfg.items()}
    _forward_kernel[(triton.cdiv(total, cfg["BLOCK_T"]),)](
        x, u, weight.contiguous(), bias.contiguous(), out,
        total, dim, x.stride(0), u.stride(0), out.stride(0), eps,
        BLOCK_T=cfg["BLOCK_T"], BLOCK_D=block_d, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def layer_norm_gate_grad(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_out [T, I] and layer_norm_gate's arguments -> (dx, du, dweight, dbias), each in its
    argument's dtype, computed in fp32."""
    total, dim = x.shape
    dx = torch.empty((total, dim), dtype=x.dtype, device=x.device)
    du = torch.empty((total, dim), dtype=u.dtype, device=u.device)
    dw = torch.empty((dim,), dtype=weight.dtype, device=weight.device)
    db = torch.empty((dim,), dtype=bias.dtype, device=bias.device)
    if dim == 0:
        return dx, du, dw, db
    if total == 0:
        return dx, du, dw.zero_(), db.zero_()
    grad_out, x, u = _rows(grad_out), _rows(x), _rows(u)
    block_d = triton.next_power_of_2(dim)
    cfg = _backward_config(block_d, interpreted=x.device.type == "cpu")
    cfg = {
        name: value if KNOBS["GRAD_" + name] is None else KNOBS["GRAD_" + name] for name, value in cfg.items()
    }
    blocks = triton.cdiv(total, cfg["BLOCK_T"])
    steps = triton.cdiv(blocks, cfg["PROGRAMS"])
    programs = triton.cdiv(blocks, steps)
    dw_part = torch.empty((programs, dim), dtype=torch.float32, device=x.device)
    db_part = torch.empty((programs, dim), dtype=torch.float32, device=x.device)
    _backward_kernel[(programs,)](
        grad_out, x, u, weight.contiguous(), bias.contiguous(), dx, du, dw_part, db_part,
        total, dim, steps, grad_out.stride(0), x.stride(0), u.stride(0), dx.stride(0), du.stride(0), eps,
        BLOCK_T=cfg["BLOCK_T"], BLOCK_D=block_d, num_warps=cfg["num_warps"],
    )  # fmt: skip
    block_c = min(block_d, 32)
    _sum_partials_kernel[(triton.cdiv(dim, block_c),)](
        dw_part, db_part, dw, db, programs, dim, BLOCK_P=32, BLOCK_C=block_c, num_warps=4
    )
    return dx, du, dw, db
