"""The public embedding-bag op (`kernels.ops.embedding_bag`) against torch's, forward and
forward+backward, at the workload's shapes: short bags (1 to 3 ids, most of one) as well as
power-law bags of up to 120, D from 16 to 256, fp32 and bf16, weighted or not. It imports
`kernels.ops` from whatever tree is first on sys.path and needs nothing else of recforge, so the
same file times two commits side by side (one process per tree, the same shapes and seeds):

    python3 -m evals.studies.embedding_bag_public [--json PATH] [--label NAME]
    PYTHONPATH=/tmp/before python3 evals/studies/embedding_bag_public.py --label before

Each time is the median of CUDA-event timings over fresh L2 (a 256 MiB write between calls),
after warm-up calls that compile and autotune. fwd+bwd is one forward and the backward of a
fixed upstream gradient (weight gradient dense, as `torch.nn.functional.embedding_bag` gives).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

# name, rows, D, bags, bag lengths ("short": 1 to 3, P = .6/.25/.15; an int: power law 1..N,
# P(L) ~ L^-1.1), weighted, dtypes
SHAPES = (
    ("b64k-d128-1m-pl120", 1_000_000, 128, 65_536, 120, False, ("fp32", "bf16")),
    ("b256k-d64-4m-pl120", 4_000_000, 64, 262_144, 120, False, ("fp32", "bf16")),
    ("b256k-d64-4m-pl120-w", 4_000_000, 64, 262_144, 120, True, ("bf16",)),
    ("b256k-d64-4m-short", 4_000_000, 64, 262_144, "short", False, ("fp32", "bf16")),
    ("b64k-d16-100k-short", 100_000, 16, 65_536, "short", False, ("fp32", "bf16")),
    ("b64k-d256-1m-pl120", 1_000_000, 256, 65_536, 120, False, ("bf16",)),
    ("b300k-d128-10m-short", 10_000_000, 128, 300_000, "short", False, ("bf16",)),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLUSH = 256 * 1024**2


def lengths_of(kind, bags: int, gen: torch.Generator, device) -> torch.Tensor:
    if kind == "short":
        probs = torch.tensor([0.6, 0.25, 0.15], device=device)
    else:
        probs = torch.arange(1, kind + 1, dtype=torch.float32, device=device).pow(-1.1)
    return torch.multinomial(probs / probs.sum(), bags, replacement=True, generator=gen) + 1


def inputs(rows, dim, bags, kind, weighted, dtype, seed, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    lengths = lengths_of(kind, bags, gen, device)
    offsets = torch.zeros(bags + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    nnz = int(offsets[-1])
    indices = torch.randint(0, rows, (nnz,), generator=gen, device=device)
    weight = torch.randn(rows, dim, generator=gen, device=device).to(dtype)
    psw = torch.rand(nnz, generator=gen, device=device).to(dtype) if weighted else None
    return weight, indices, offsets, psw, nnz


def median_ms(fn, reps: int = 25) -> float:
    flush = torch.empty(FLUSH, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(ops, label: str, name: str, rows, dim, bags, kind, weighted, dt: str) -> list[dict]:
    weight, indices, offsets, psw, nnz = inputs(rows, dim, bags, kind, weighted, DTYPES[dt], 7, "cuda")
    ours = ops.embedding_bag(weight, indices, offsets, per_sample_weights=psw)
    theirs = F.embedding_bag(indices, weight, offsets[:-1], mode="sum", per_sample_weights=psw)
    err = float((ours.float() - theirs.float()).norm() / theirs.float().norm().clamp(min=1e-30))
    leaf = weight.detach().requires_grad_(True)
    grad = torch.randn_like(ours)

    def ours_fwd():
        return ops.embedding_bag(weight, indices, offsets, per_sample_weights=psw)

    def torch_fwd():
        return F.embedding_bag(indices, weight, offsets[:-1], mode="sum", per_sample_weights=psw)

    def ours_fb():
        leaf.grad = None
        ops.embedding_bag(leaf, indices, offsets, per_sample_weights=psw).backward(grad)

    def torch_fb():
        leaf.grad = None
        F.embedding_bag(indices, leaf, offsets[:-1], mode="sum", per_sample_weights=psw).backward(grad)

    rows_out = []
    for pass_name, mine, other in (("fwd", ours_fwd, torch_fwd), ("fwd+bwd", ours_fb, torch_fb)):
        a, b = median_ms(mine), median_ms(other)
        rows_out.append({"label": label, "shape": name, "dtype": dt, "pass": pass_name, "nnz": nnz,
                         "ops_ms": a, "torch_ms": b, "rel_err_vs_torch": err})  # fmt: skip
        print(f"{name:24} {dt:5} {pass_name:7} {a:9.3f} {b:9.3f} {b / a:7.2f}x  err {err:.1e}", flush=True)
    return rows_out


def main(argv: list[str] | None = None) -> int:
    from kernels import ops

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--label", default="this tree")
    args = parser.parse_args(argv)
    rows_out = []
    head = f"{'shape':24} {'dtype':5} {'pass':7} {'ops ms':>9} {'torch ms':>9} {'vs torch':>8}"
    print(f"{head}  ({args.label})")
    for name, rows, dim, bags, kind, weighted, dtypes in SHAPES:
        for dt in dtypes:
            rows_out += measure(ops, args.label, name, rows, dim, bags, kind, weighted, dt)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "a") as f:
            for row in rows_out:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
