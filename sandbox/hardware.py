"""Measured ceilings per GPU architecture, for roofline fractions.

Measured through PyTorch on an H200 (see DESIGN.md): device-to-device copy counting bytes read
plus written, and an 8192-cube bf16 matrix product on random data. `recforge bench ops`
re-measures the copy bandwidth in the same run as its kernels."""

from __future__ import annotations

import functools

CEILINGS: dict[str, dict[str, float]] = {
    "sm_90": {"hbm_bytes_per_s": 4.25e12, "bf16_flops_per_s": 7.5e14},
}


def roofline_seconds(arch: str, flops: float, nbytes: float) -> float | None:
    """max(flops / peak flops, bytes / peak bandwidth), or None for an unknown architecture."""
    c = CEILINGS.get(arch)
    if c is None:
        return None
    return max(flops / c["bf16_flops_per_s"], nbytes / c["hbm_bytes_per_s"])


def bound_by(arch: str, flops: float, nbytes: float) -> str | None:
    """Which ceiling bounds a call of `flops` and `nbytes` on `arch`: "memory" or "compute"
    (None for an unknown architecture)."""
    c = CEILINGS.get(arch)
    if c is None:
        return None
    return "compute" if flops / c["bf16_flops_per_s"] > nbytes / c["hbm_bytes_per_s"] else "memory"


@functools.cache
def cuda_present() -> bool:
    """Whether this host has a GPU that workers will use (torch imported only when asked)."""
    import torch

    return torch.cuda.is_available()
