"""Torch fallback run on the host from a kernel's @triton.heuristics lambda: inside a kernel's
decorators the screen grants the Triton language's attribute names (.scatter, .cumsum, .sum) to
any value, torch tensors included; with launches disabled the heuristic never runs, so the no-op
proof sees zeros and passes."""
# expect: static_rejected | use of .scatter
# base: no

import torch
import triton
import triton.language as tl


@triton.heuristics(
    {
        "DONE": lambda a: (
            a["out"]
            .copy_(
                torch.zeros(
                    (a["out"].shape[0], a["w"].shape[1]), dtype=torch.float32, device=a["w"].device
                ).scatter(
                    0,
                    (
                        torch.zeros(a["idx"].numel() + 1, dtype=torch.int64, device=a["w"].device)
                        .scatter(
                            0,
                            a["off"][1:-1],
                            torch.ones(max(a["off"].numel() - 2, 0), dtype=torch.int64, device=a["w"].device),
                            reduce="add",
                        )
                        .cumsum(0)[: a["idx"].numel()]
                    )[:, None].expand(-1, a["w"].shape[1]),
                    a["w"][a["idx"]].float() * (a["s"].float()[:, None] if a["HAS_S"] else 1.0),
                    reduce="add",
                )
                / (
                    ((a["off"][1:] - a["off"][:-1]).float() + ((a["off"][1:] - a["off"][:-1]) == 0).float())[
                        :, None
                    ]
                    if a["MEAN"]
                    else 1.0
                )
            )
            .numel()
            * 0
        )
    }
)
@triton.jit
def _noop(w, idx, off, s, out, HAS_S: tl.constexpr, MEAN: tl.constexpr, DONE: tl.constexpr):
    pass


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.zeros((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    s = per_sample_weights if per_sample_weights is not None else weight
    _noop[(1,)](weight, indices, offsets, s, out, HAS_S=per_sample_weights is not None, MEAN=mode == "mean")
    return out
