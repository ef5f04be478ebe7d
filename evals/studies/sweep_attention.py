"""Launch-configuration sweep of the attention kernels on a GPU, with a correctness check of each.

For each op and timing shape: the forward under each tile configuration, then the backward's
dK/dV kernel and dQ kernel configurations (one varied at a time, the other at its default);
every variant's output is compared with the default configuration's and with the fp32
reference, so a configuration that is fast but wrong shows as such. Prints one table per op and
writes JSON lines.

    python3 -m evals.studies.sweep_attention [--out rows.jsonl] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kernels import attention as ka
from sandbox.protocol import compare, fresh_seed
from sandbox.timing import benchmark
from search_space import get_problem

FWD_CONFIGS = [
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (128, 32, 4, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 128, 4, 2),
    (128, 128, 8, 3),
    (64, 32, 4, 4),
]
DKDV_CONFIGS = [
    (32, 64, 8, 2),
    (64, 64, 8, 2),
    (32, 128, 8, 2),
    (64, 128, 8, 2),
    (16, 64, 4, 3),
    (32, 64, 4, 3),
]
DQ_CONFIGS = [
    (64, 32, 8, 2),
    (64, 64, 8, 2),
    (128, 32, 8, 2),
    (128, 64, 8, 2),
    (64, 64, 4, 3),
    (32, 64, 4, 3),
]

CASES = {
    "jagged_attention": ["b256-n4096-power-softmax", "b256-n4096-uniform-silu"],
    "gdpa": ["self-b1024-n2048-s0.5-gelu"],
    "target_attention": ["r15-c70-s32-h2000-softmax"],
}


def _call(op: str, inputs, **config):
    args, kwargs = inputs.args, dict(inputs.kwargs)
    fwd = {
        "jagged_attention": ka.jagged_attention_forward,
        "gdpa": ka.gdpa_forward,
        "target_attention": ka.target_attention_forward,
    }[op]
    return fwd(*args, **kwargs, **config)


def _backward(op: str, inputs, grad_out, out, lse, **config):
    args, kwargs = inputs.args, dict(inputs.kwargs)
    bwd = {
        "jagged_attention": ka.jagged_attention_backward,
        "gdpa": ka.gdpa_backward,
        "target_attention": ka.target_attention_backward,
    }[op]
    if op == "gdpa":  # pointwise activations only: no softmax statistics to pass back
        return bwd(grad_out, *args, **kwargs, **config)
    return bwd(grad_out, *args, out, lse, **kwargs, **config)


def _named(prefix: str, cfg: tuple) -> dict:
    m, n, w, s = cfg
    return {f"{prefix}block_m": m, f"{prefix}block_n": n, f"{prefix}num_warps": w, f"{prefix}num_stages": s}


def sweep(op: str, shape_name: str, device: torch.device, quick: bool) -> list[dict]:
    problem = get_problem(op)
    shape = next(s for s in problem.timing_shapes if s.name == shape_name)
    inputs = problem.make_inputs(shape, fresh_seed(), device)
    ref = problem.reference(*inputs.args, **inputs.kwargs)
    tol = problem.tolerance(shape.dtype)
    flops = problem.flops(shape)
    rows = []
    if op == "gdpa":
        default_out, lse = _call(op, inputs), None
    else:
        default_out, lse = _call(op, inputs, return_lse=True)
    fwd_configs = FWD_CONFIGS[:3] if quick else FWD_CONFIGS
    for cfg in fwd_configs:
        row = {"op": op, "shape": shape_name, "pass": "fwd", "config": list(cfg)}
        try:
            out = _call(op, inputs, **_named("", cfg))
            ok, det = compare(out, ref, tol, problem.tolerance_scale(inputs))
            row["vs_default_max_abs"] = float((out.float() - default_out.float()).abs().max())
            row["check"] = "ok" if ok else det["message"][:80]
            stats = benchmark(
                lambda cfg=cfg: _call(op, inputs, **_named("", cfg)), [((), {})], device=device, max_reps=50
            )
            row["ms"] = stats.median_us / 1e3
            row["tflops"] = flops / (stats.median_us * 1e-6) / 1e12
        except Exception as exc:  # a configuration that does not compile or fit is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    grad_out = torch.randn(default_out.shape, generator=gen, device=device).to(default_out.dtype)
    default_grads = _backward(op, inputs, grad_out, default_out, lse)
    variants = [("dkdv", cfg, _named("", cfg)) for cfg in DKDV_CONFIGS] + [
        ("dq", cfg, _named("dq_", cfg)) for cfg in DQ_CONFIGS
    ]
    if quick:
        variants = variants[:2] + variants[len(DKDV_CONFIGS) : len(DKDV_CONFIGS) + 2]
    for kernel, cfg, config in variants:
        row = {"op": op, "shape": shape_name, "pass": f"bwd-{kernel}", "config": list(cfg)}
        try:
            grads = _backward(op, inputs, grad_out, default_out, lse, **config)
            diffs = [
                float((g.float() - d.float()).abs().max() / max(d.float().abs().max().item(), 1e-6))
                for g, d in zip(grads[:3], default_grads[:3], strict=True)
            ]
            row["vs_default_rel"] = max(diffs)
            stats = benchmark(
                lambda config=config: _backward(op, inputs, grad_out, default_out, lse, **config),
                [((), {})],
                device=device,
                max_reps=30,
            )
            row["ms"] = stats.median_us / 1e3
            row["tflops"] = 2.5 * flops / (stats.median_us * 1e-6) / 1e12
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def diagnose_realistic(device: torch.device) -> None:
    """Where the default kernels disagree with the fp32 reference on a realistic case: every
    combination of targets and relative bias, under several forward configurations, plus the
    backward's gradients against autograd of the reference."""
    from search_space.attention import jagged_attention_reference

    lengths = [1024, 639, 58, 460, 313, 29, 27, 403]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.tensor(lengths, device=device).cumsum(0)
    total = int(offsets[-1])
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(total, 4, 128, generator=gen, device=device).bfloat16() for _ in range(3))
    bias = torch.randn(4, 64, generator=gen, device=device)
    targets = torch.full((len(lengths),), 16, device=device)
    starts = offsets[:-1].tolist()
    for activation in ("softmax", "silu"):
        for with_targets, with_bias in ((False, False), (True, False), (False, True), (True, True)):
            extra = {
                "num_targets": targets if with_targets else None,
                "rel_bias": bias if with_bias else None,
                "max_seq_len": 1024,
                "activation": activation,
            }
            ref = jagged_attention_reference(q.float(), k.float(), v.float(), offsets, **extra)
            rms = ref.pow(2).mean().sqrt()
            for cfg in [None, (64, 32, 4, 1), (64, 32, 4, 3), (128, 64, 8, 3), (16, 16, 1, 1)]:
                config = {} if cfg is None else _named("", cfg)
                out = ka.jagged_attention_forward(q, k, v, offsets, **extra, **config).float()
                err = (out - ref).abs()
                bad = (err > 0.05 * rms + 0.02 * ref.abs()).any(-1)  # [T, H]
                where = []
                for t, h in bad.nonzero().tolist()[:4]:
                    seq = max(i for i, s in enumerate(starts) if s <= t)
                    where.append((seq, t - starts[seq], h))
                print(
                    f"diag {activation} targets={with_targets} bias={with_bias} cfg={cfg or 'default'} "
                    f"max_err={err.max().item():.4f} bad_rows={int(bad.sum())} first={where}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="append JSON rows here")
    parser.add_argument("--quick", action="store_true", help="three forward and four backward configurations")
    parser.add_argument("--diagnose", action="store_true", help="only the realistic-case diagnosis")
    args = parser.parse_args()
    device = torch.device("cuda")
    t0 = time.time()
    diagnose_realistic(device)
    if args.diagnose:
        return
    rows = []
    for op, shapes in CASES.items():
        for shape in shapes:
            rows += sweep(op, shape, device, args.quick)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"sweep took {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
