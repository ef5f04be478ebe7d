"""Row-wise Adagrad for embedding tables: one accumulator per row, not per element.

For each row i with gradient g_i (the sum over the bags that looked it up):
    state_i += mean(g_i^2)
    w_i     -= lr * g_i / (sqrt(state_i) + eps)
Rows no bag looked up have a zero gradient and stay as they are, their state too. The state is
fp32 whatever the table's dtype. A table's gradient may be dense or a sparse COO tensor of rows.

A flat parameter holding several tables one after another (model.embeddings, unfused) gives
their layout with it, a param group's `tables`: (element offset, rows, dim) of each.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class RowWiseAdagrad(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 0.05, eps: float = 1e-8) -> None:
        if lr <= 0 or eps <= 0:
            raise ValueError(f"lr and eps must be > 0, got {lr} and {eps}")
        super().__init__(params, {"lr": lr, "eps": eps, "tables": None})
        for group in self.param_groups:
            for p in group["params"]:
                flat = group["tables"] is not None and p.dim() == 1
                if p.dim() != 2 and not flat:
                    raise ValueError(
                        f"row-wise Adagrad updates tables [rows, dim] (or a flat buffer of them with "
                        f"their `tables` layout), got shape {tuple(p.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch.optim.Optimizer's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() == 1:  # a flat buffer of tables: each table in turn, dense
                    rows = sum(r for _, r, _ in group["tables"])
                    state = self.state[p]
                    if "sum" not in state:
                        state["sum"] = torch.zeros(rows, dtype=torch.float32, device=p.device)
                    grad, at = p.grad.to_dense(), 0
                    for start, num_rows, dim in group["tables"]:
                        span = slice(start, start + num_rows * dim)
                        table, table_grad = p[span].view(num_rows, dim), grad[span].view(num_rows, dim)
                        _dense_step(table, table_grad, state["sum"][at : at + num_rows], lr, eps)
                        at += num_rows
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                if p.grad.is_sparse:
                    grad = p.grad.coalesce()
                    if grad.sparse_dim() != 1:  # element-sparse: as rows
                        grad = grad.to_dense().to_sparse(sparse_dim=1)
                    rows, values = grad.indices()[0], grad.values().float()
                    state["sum"].index_add_(0, rows, values.pow(2).mean(1))
                    scale = lr / (state["sum"][rows].sqrt() + eps)
                    p.index_add_(0, rows, (-values * scale.unsqueeze(1)).to(p.dtype))
                else:
                    _dense_step(p, p.grad, state["sum"], lr, eps)
        return loss


def _dense_step(table: torch.Tensor, grad: torch.Tensor, sums: torch.Tensor, lr: float, eps: float) -> None:
    """The step on a [rows, dim] table from its dense gradient (rows of zeros stay as they are)."""
    grad = grad.float()
    sums.add_(grad.pow(2).mean(1))
    table.sub_((grad * (lr / (sums.sqrt() + eps)).unsqueeze(1)).to(table.dtype))
