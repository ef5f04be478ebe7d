"""The HSTU layer with its output norm and gate as one op (`kernels.ops.layer_norm_gate`) against
the same layer with torch's `layer_norm` and a multiply, side by side in one process: forward and
forward+backward under bf16 autocast, as the model trains, at the large config's layer (model
dim 512, 4 heads of 128) over jagged histories of the workload's lengths. One CUDA device;
prints a table. On a CPU
(interpreted Triton) it only shows that the study runs.

    python3 -m evals.studies.hstu_norm_gate [REQUESTS ...]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import model.hstu as hstu
from sandbox.timing import benchmark

_FUSED = hstu.layer_norm_gate  # the layer's own, put back after each torch variant


def _torch_norm_gate(x, u, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps) * u


def _histories(requests: int, device: torch.device, seed: int) -> tuple[torch.Tensor, int]:
    """Offsets of `requests` histories, log-normal lengths of median 500 clipped to [1, 4096]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(requests, generator=g) * 0.8 + torch.log(torch.tensor(500.0)))
    lengths = lengths.round().clamp(1, 4096).long()
    offsets = torch.zeros(requests + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    return offsets.to(device), int(offsets[-1])


def main(requests: list[int]) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    layer = hstu.HSTULayer(512, 4, 128, num_buckets=32, max_seq_len=4096, device=device)
    rows = []
    for n in requests:
        arg_sets = []
        for seed in range(3):
            offsets, total = _histories(n, device, seed)
            x = torch.randn(total, 512, device=device, requires_grad=True)
            arg_sets.append(((x, offsets), {}))

        def forward(x, offsets):
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                return layer(x, offsets)

        def train(x, offsets):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = layer(x, offsets)
            out.float().square().mean().backward()
            x.grad = None

        for variant, fn in (("fused", hstu.layer_norm_gate), ("torch", _torch_norm_gate)):
            hstu.layer_norm_gate = fn
            try:
                for mode, call in (("fwd", forward), ("fwd+bwd", train)):
                    stats = benchmark(call, arg_sets, device=device, target_ms=400)
                    rows.append((n, arg_sets[0][0][0].shape[0], variant, mode, stats.median_us))
            finally:
                hstu.layer_norm_gate = _FUSED
        layer.zero_grad(set_to_none=True)

    print(f"{'requests':>8} {'tokens':>9} {'mode':>8} {'fused us':>10} {'torch us':>10} {'torch/fused':>11}")
    for n, tokens, _, mode, fused_us in [r for r in rows if r[2] == "fused"]:
        torch_us = next(r[4] for r in rows if r[0] == n and r[3] == mode and r[2] == "torch")
        ratio = torch_us / fused_us
        print(f"{n:>8} {tokens:>9} {mode:>8} {fused_us:>10.1f} {torch_us:>10.1f} {ratio:>11.2f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [32, 256])
