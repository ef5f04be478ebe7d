"""Side-by-side timing of attention kernel variants on a GPU, each checked on the way.

A variant is a kernel module (this tree's kernels.attention, or another file with the same
launchers, such as an earlier commit's kernels/attention.py given with --baseline) plus launch
options (tiles). For each case (op, timing shape) every variant's forward is compared with the fp32
reference and its backward with the current default's gradients, then both are timed in the
same process; ratios are against the case's first variant. A case is "<op>/<timing shape>", or
"<study>/<op>/<timing shape>" for another set of variants of the same shape. With --profile,
the CUDA kernels of one forward call of the current default are listed (where the time goes
besides the kernel).

    git show <commit>:kernels/attention.py > /tmp/prev_attention.py
    python3 -m evals.studies.compare_attention --baseline /tmp/prev_attention.py \
        [--case NAME] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from types import ModuleType

import torch

from evals.bench_attention import graphed, without_bounds
from evals.studies import module_from_file
from kernels import attention as current
from sandbox.protocol import compare, fresh_seed
from sandbox.timing import benchmark
from search_space import get_problem
from search_space.problem import Inputs

FORWARDS = {"jagged_attention": "jagged_attention_forward", "gdpa": "gdpa_forward"}
FORWARDS["target_attention"] = "target_attention_forward"


def _tiles(m: int, n: int, w: int, s: int, prefix: str = "") -> dict:
    return {f"{prefix}block_m": m, f"{prefix}block_n": n, f"{prefix}num_warps": w, f"{prefix}num_stages": s}


# (label, module key, forward options, backward options). The key is "prev" (the --baseline
# module), "cur" (this tree) or "ops" (this tree through kernels.ops, forward only), with
# "-graph" for calls replayed from a CUDA graph.
SCHEDULES = [
    ("previous", "prev", {}, {}),
    ("this tree", "cur", {}, {}),
]
TARGET_TILES = [
    ("fwd 128x128 w8 s2", "cur", _tiles(128, 128, 8, 2), {}),
    ("fwd 64x128 w4 s3", "cur", _tiles(64, 128, 4, 3), {}),
    ("fwd 64x64 w4 s3", "cur", _tiles(64, 64, 4, 3), {}),
    ("dkdv 64x128 w8 s2", "cur", {}, _tiles(64, 128, 8, 2)),
]
# The default kernels through the public op (forward only, no gradient), and launched with
# bounds (target attention: no host sync) directly or replayed from a CUDA graph.
OP_PATHS = [("kernels.ops", "ops", {}, {})]
BOUNDS = {"bounds": True}
SYNC_FREE = [
    ("bounds (no host sync)", "cur", BOUNDS, BOUNDS),
    ("bounds, CUDA graph", "cur-graph", BOUNDS, BOUNDS),
    ("kernels.ops, bounds, CUDA graph", "ops-graph", BOUNDS, {}),
]
# The softmax forward with its score scale folded into the exponent (this tree) against the
# previous commit, and forward tilings by TMA; the backward kernels do not change (None: the
# backward is not timed).
FWD_TILES = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2), (128, 128, 8, 2)]
FOLD = [("previous", "prev", {}, {}), ("this tree", "cur", {}, None)] + [
    (f"fwd {m}x{n} w{w} s{st}", "cur", _tiles(m, n, w, st), None) for m, n, w, st in FWD_TILES
]
TARGET_FOLD = [
    ("previous, bounds, CUDA graph", "prev-graph", BOUNDS, BOUNDS),
    ("bounds, CUDA graph", "cur-graph", BOUNDS, None),
    *(
        (f"bounds, CUDA graph, fwd {m}x{n} w{w} s{st}", "cur-graph", {**BOUNDS, **_tiles(m, n, w, st)}, None)
        for m, n, w, st in FWD_TILES
    ),
    ("kernels.ops, bounds, CUDA graph", "ops-graph", BOUNDS, {}),
]
# The last key tile of a sequence shifted back to end at its last key, against the masked loop
# after the pipelined one, the default (kernels/kit/attention_forward.py: SHIFT_LAST_MAX_KEYS) and the
# previous commit.
NO_SHIFT = {"shift_last": False}
SHIFT = [
    ("previous, bounds, CUDA graph", "prev-graph", BOUNDS, None),
    ("masked last tile, bounds, CUDA graph", "cur-graph", {**BOUNDS, **NO_SHIFT}, None),
    ("shifted last tile, bounds, CUDA graph", "cur-graph", {**BOUNDS, "shift_last": True}, None),
    ("bounds, CUDA graph", "cur-graph", BOUNDS, None),
    ("kernels.ops, bounds, CUDA graph", "ops-graph", BOUNDS, {}),
]
SHIFT_EAGER = [
    ("previous", "prev", {}, None),
    ("masked last tile", "cur", NO_SHIFT, None),
    ("shifted last tile", "cur", {"shift_last": True}, None),
    ("this tree", "cur", {}, None),
]
SHIFT_CASES = [
    "target_attention/r15-c70-s32-h2000-softmax",
    "target_attention/r15-c70-s256-h2000-softmax",
    "target_attention/r1-c2048-s32-h16k-softmax",
    "gdpa/self-b1024-n2048-s0.5-gelu",
    "gdpa/cross-b1024-q2048-s0.75-kv256-gelu",
    "gdpa/broadcast-b1024-seeds32-kv2048-s0.75-gelu",
]
CASES = {
    "jagged_attention/b256-n4096-power-softmax": SCHEDULES + OP_PATHS,
    "jagged_attention/b256-n8192-power-softmax": SCHEDULES,
    "jagged_attention/b512-n1024-uniform-softmax": SCHEDULES,
    "jagged_attention/b256-n4096-uniform-silu": SCHEDULES,
    "jagged_attention/b512-n4096-power-silu-targets-bias": SCHEDULES,
    "gdpa/self-b1024-n2048-s0.5-gelu": SCHEDULES,
    "bounds/gdpa/self-b1024-n2048-s0.5-gelu": [("this tree", "cur", {}, {}), *OP_PATHS, *SYNC_FREE],
    "bounds/gdpa/cross-b1024-q2048-s0.75-kv256-gelu": [("this tree", "cur", {}, {}), *OP_PATHS, *SYNC_FREE],
    "bounds/gdpa/broadcast-b1024-seeds32-kv2048-s0.75-gelu": [
        ("this tree", "cur", {}, {}),
        *OP_PATHS,
        *SYNC_FREE,
    ],
    "target_attention/r15-c70-s32-h2000-softmax": SCHEDULES
    + OP_PATHS
    + [("previous, bounds, CUDA graph", "prev-graph", BOUNDS, BOUNDS)]
    + SYNC_FREE
    + [
        (
            f"bounds, CUDA graph, fwd 128x64 w8 s{st}",
            "cur-graph",
            {**BOUNDS, **_tiles(128, 64, 8, st)},
            BOUNDS,
        )
        for st in (3, 4)
    ],
    "target_attention/r1-c2048-s32-h16k-softmax": SCHEDULES + TARGET_TILES[:2],
    "fold/jagged_attention/b256-n4096-power-softmax": FOLD + OP_PATHS,
    "fold/jagged_attention/b512-n1024-uniform-softmax": FOLD,
    "fold/target_attention/r15-c70-s32-h2000-softmax": TARGET_FOLD,
    "fold/target_attention/r15-c70-s256-h2000-softmax": TARGET_FOLD,
    "fold/target_attention/r1-c2048-s32-h16k-softmax": TARGET_FOLD,
    **{f"shift/{case}": SHIFT for case in SHIFT_CASES},
    **{
        f"shift/jagged_attention/{shape}": SHIFT_EAGER
        for shape in ("b256-n4096-power-softmax", "b256-n8192-power-softmax", "b512-n1024-uniform-softmax")
    },
    # 128 x 64 tiles in two stages fit two programs' shared memory on one SM.
    "cta2/target_attention/r15-c70-s32-h2000-softmax": [
        ("bounds, CUDA graph", "cur-graph", BOUNDS, None),
        ("bounds, CUDA graph, fwd 128x64 w8 s2", "cur-graph", {**BOUNDS, **_tiles(128, 64, 8, 2)}, None),
    ],
}


def _forward(module: ModuleType, op: str, inputs, options: dict, lse: bool = False):
    fn = getattr(module, FORWARDS[op])
    extra = {"return_lse": True} if lse and op != "gdpa" else {}
    return fn(*inputs.args, **inputs.kwargs, **options, **extra)


def _op_forward(op: str, inputs, options: dict):
    from kernels import ops

    with torch.no_grad():
        return getattr(ops, op)(*inputs.args, **inputs.kwargs, **options)


def _bounded(op: str, inputs: Inputs, options: dict) -> tuple[Inputs, dict]:
    """(inputs, options) of a variant: the problem's inputs carry the op's launch bounds, which
    {"bounds": False} (the default) takes out (the call then measures the lengths itself)."""
    if options.pop("bounds", False):
        return inputs, options
    return Inputs(args=inputs.args, kwargs=without_bounds(op, inputs.kwargs)), options


def _backward(module: ModuleType, op: str, inputs, grad_out, out, lse, options: dict):
    fn = getattr(module, FORWARDS[op].replace("forward", "backward"))
    if op == "gdpa":  # pointwise activations: nothing saved from the forward
        return fn(grad_out, *inputs.args, **inputs.kwargs, **options)
    return fn(grad_out, *inputs.args, out, lse, **inputs.kwargs, **options)


def _median_ms(fn, device: torch.device, reps: int, replayed: bool = False) -> float:
    # A graph's replay is timed to its last kernel (joined_streams): capture admits no work left
    # on another stream, so the synchronize's host round trip would only add its own latency.
    stats = benchmark(fn, [((), {})], device=device, max_reps=reps, joined_streams=replayed)
    return stats.median_us / 1e3


def _profile(module: ModuleType, op: str, inputs) -> None:
    from torch.profiler import ProfilerActivity, profile

    inputs, options = _bounded(op, inputs, {"bounds": op == "target_attention"})
    for _ in range(2):
        _forward(module, op, inputs, options)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            _forward(module, op, inputs, options)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


def run_case(case: str, variants: list, modules: dict, device: torch.device, profile: bool) -> list[dict]:
    op, shape_name = case.split("/")[-2:]  # "<study>/<op>/<shape>" or "<op>/<shape>"
    problem = get_problem(op)
    shape = next(s for s in problem.timing_shapes if s.name == shape_name)
    inputs = problem.make_inputs(shape, fresh_seed(), device)
    ref = problem.reference(*inputs.args, **inputs.kwargs)
    tol, scale = problem.tolerance(shape.dtype), problem.tolerance_scale(inputs)
    flops = problem.flops(shape)
    out0 = _forward(current, op, inputs, {}, lse=True)
    out0, lse0 = out0 if isinstance(out0, tuple) else (out0, None)
    gen = torch.Generator(device=device).manual_seed(0)
    grad_out = torch.randn(out0.shape, generator=gen, device=device).to(out0.dtype)
    grads0 = _backward(current, op, inputs, grad_out, out0, lse0, {})
    if profile:
        _profile(current, op, inputs)
    rows = []
    for label, key, fwd_options, bwd_options in variants:
        module_key, replayed = key.removesuffix("-graph"), key.endswith("-graph")
        if module_key not in modules and module_key != "ops":
            continue
        module = modules.get(module_key, current)
        fwd_inputs, fwd_options = _bounded(op, inputs, dict(fwd_options))
        if bwd_options is not None:
            bwd_inputs, bwd_options = _bounded(op, inputs, dict(bwd_options))
        row = {"case": case, "variant": label}
        try:
            if module_key == "ops":
                forward = partial(_op_forward, op, fwd_inputs, fwd_options)
            else:
                forward = partial(_forward, module, op, fwd_inputs, fwd_options)
            if replayed:
                forward, out = graphed(forward)
                forward()
            else:
                out = forward()
            ok, details = compare(out, ref, tol, scale)
            row["fwd_check"] = "ok" if ok else details["message"][:80]
            row["fwd_ms"] = _median_ms(forward, device, 50, replayed)
            row["fwd_tflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
            # The op's backward runs under autograd; None: a variant whose backward is the default's.
            if module_key == "ops" or bwd_options is None:
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            backward = partial(_backward, module, op, bwd_inputs, grad_out, out0, lse0, bwd_options)
            if replayed:
                backward, grads = graphed(backward)
                backward()
            else:
                grads = backward()
            row["bwd_vs_default"] = max(
                float((g.float() - d.float()).abs().max() / d.float().abs().max().clamp_min(1e-6))
                for g, d in zip(grads[:3], grads0[:3], strict=True)
            )
            row["bwd_ms"] = _median_ms(backward, device, 30, replayed)
            row["bwd_tflops"] = 2.5 * flops / (row["bwd_ms"] * 1e-3) / 1e12
        except Exception as exc:  # a variant that does not compile or fit is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| case | variant | fwd ms | fwd TFLOP/s | fwd x | bwd ms | bwd TFLOP/s | bwd x | checks |"]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    first: dict[str, dict] = {}
    for r in rows:
        base = first.setdefault(r["case"], r)
        if "error" in r:
            lines.append(f"| {r['case']} | {r['variant']} | | | | | | | {r['error'][:60]} |")
            continue
        fx = base.get("fwd_ms", float("nan")) / r["fwd_ms"]
        fwd = f"{r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {fx:.2f}"
        bwd, check = "| |", f"fwd {r['fwd_check']}"
        if "bwd_ms" in r:
            bx = base.get("bwd_ms", float("nan")) / r["bwd_ms"]
            bwd = f"{r['bwd_ms']:.3f} | {r['bwd_tflops']:.0f} | {bx:.2f}"
            check += f", bwd rel {r['bwd_vs_default']:.1e}"
        lines.append(f"| {r['case']} | {r['variant']} | {fwd} | {bwd} | {check} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", help="another kernels/attention.py to compare (variant 'previous')")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases")
    parser.add_argument("--profile", action="store_true", help="list the kernels of one forward per case")
    parser.add_argument("--out", help="append JSON rows here")
    args = parser.parse_args()
    device = torch.device("cuda")
    modules = {"cur": current}
    if args.baseline:
        modules["prev"] = module_from_file(args.baseline, "baseline_attention")
    t0 = time.time()
    rows = []
    for case in args.case or list(CASES):
        rows += run_case(case, CASES[case], modules, device, args.profile and "target_attention/" in case)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"took {time.time() - t0:.0f} s")
    print(table(rows))


if __name__ == "__main__":
    main()
