"""Where the time of one target-attention forward goes, at the request shapes (15 requests x 70
candidates, 32 and 256 seeds), with bounds (no host sync):

1. the op replayed from a CUDA graph, timed three ways: `sandbox.timing.benchmark` as the
   benches use it (a device-wide synchronize before each end event), the same with the end
   event right after the replay (`joined_streams`), and 200 replays back to back between two
   events (no L2 flush between them);
2. the CUDA kernels of the replays, by the profiler;
3. the attention kernel's programs at those shapes and at power-law jagged lengths (causal
   softmax, N 4096), traced, with the last key tile in a masked loop of its own
   and shifted into the pipelined loop (`shift_last`): a copy of kernels/attention.py whose
   forward kernel stores, per program, the global timer at its start, once q is loaded, once
   its key tiles are done and at its end, with its SM. From the trace: how busy the SMs were
   over the kernel's span, how long the last wave left SMs idle, and each phase's mean time (the
   key tiles as a least-squares line: fixed cost plus cost per tile); and the compiled kernels'
   registers and shared memory;
4. the host time of eager calls (with and without bounds), and where it goes (cProfile).

    python3 -m evals.study_target_time [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
import triton

from evals.bench_attention import graphed, sync_free_bounds
from kernels import attention, ops
from sandbox.timing import benchmark
from search_space import get_problem

SHAPES = ("r15-c70-s32-h2000-softmax", "r15-c70-s256-h2000-softmax")


def _patched(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise RuntimeError(
            f"the trace patch expects one {old.splitlines()[0].strip()!r} in kernels/attention.py"
        )
    return text.replace(old, new)


# Appended to the traced copy: the global timer once `dep` (a [rows] fp32 tensor) is computed,
# so that a stamp waits for the loads or products it follows (the latest of the rows' reads).
STAMP = """

@triton.jit
def _stamp(dep):
    deps = dep.to(tl.int32, bitcast=True)
    t = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer; // $1", "=l,r", [deps], dtype=tl.int64, is_pure=False, pack=1
    )
    return tl.max(t, axis=0)


TRACE = [None]
"""
FIELDS = ("start", "q_ready", "loops_done", "end", "sm", "seq", "block", "n_k")


def traced_attention() -> ModuleType:
    """kernels/attention.py with its forward kernel tracing each program into the tensor the
    module's TRACE[0] holds when it is launched ([programs, len(FIELDS)] int64): its start, q
    loaded (a row sum of q waited for), its key tiles done (the row sums l waited for), its end,
    its SM, sequence (request), query block and key rows."""
    text = Path(attention.__file__).read_text()
    first = "    seq, block, head = _work_item(work_ptr, num_heads, num_q_blocks, True, WORK_LIST)\n"
    text = _patched(
        text,
        "    SHIFT_LAST: tl.constexpr,\n):\n" + first,
        "    SHIFT_LAST: tl.constexpr,\n    trace_ptr,\n):\n    t_start = tl.extra.cuda.globaltimer()\n"
        + first,
    )
    after_q = "    k_seq_ptr = k_ptr + kv_start * stride_k_row + head * stride_k_head\n"
    text = _patched(
        text,
        ")  # fmt: skip\n" + after_q,
        ")  # fmt: skip\n    t_q = _stamp(tl.sum(q_MD.to(tl.float32), axis=1))\n" + after_q,
    )
    epilogue = '    if ACTIVATION == "softmax":\n        # l = 0 only for a query with no keys at all'
    text = _patched(text, epilogue, "    t_loops = _stamp(l_M)\n" + epilogue)
    stamps = ("t_start", "t_q", "t_loops", "t_end", "tl.extra.cuda.smid()", "seq", "block", "n_k")
    stores = "".join(f"    tl.store(trace_row + {i}, ({v}).to(tl.int64))\n" for i, v in enumerate(stamps))
    text = _patched(
        text,
        "    tl.store(out_ptrs, acc_MD.to(out_ptr.dtype.element_ty), mask=in_M[:, None])\n",
        "    tl.store(out_ptrs, acc_MD.to(out_ptr.dtype.element_ty), mask=in_M[:, None])\n"
        "    t_end = tl.extra.cuda.globaltimer()\n"
        f"    trace_row = trace_ptr + tl.program_id(0) * {len(FIELDS)}\n" + stores,
    )
    text = _patched(
        text,
        '        **{**config, "USE_TMA": use_tma, "SHIFT_LAST": shift_last},\n    )  # fmt: skip\n',
        '        **{**config, "USE_TMA": use_tma, "SHIFT_LAST": shift_last}, trace_ptr=TRACE[0],\n'
        "    )  # fmt: skip\n",
    )
    text = text.replace(
        "import triton.language as tl\n",
        "import triton.language as tl\nimport triton.language.extra.cuda\n",
        1,
    )
    path = Path(tempfile.mkdtemp()) / "traced_attention.py"
    path.write_text(text + STAMP)  # Triton reads a kernel's source from its file
    spec = importlib.util.spec_from_file_location("traced_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["traced_attention"] = module
    spec.loader.exec_module(module)
    return module


def _inputs(shape_name: str, device: torch.device):
    problem = get_problem("target_attention")
    shape = next(s for s in problem.timing_shapes if s.name == shape_name)
    inputs = problem.make_inputs(shape, 1, device)
    return problem, shape, inputs, sync_free_bounds("target_attention", inputs.args, inputs.kwargs)


def timing_ways(name: str, device: torch.device) -> list[str]:
    problem, shape, inputs, bounds = _inputs(name, device)
    flops = problem.flops(shape)
    with torch.no_grad():
        replay, _ = graphed(partial(ops.target_attention, *inputs.args, **inputs.kwargs, **bounds))
    synced = benchmark(replay, [((), {})], device=device, max_reps=100).median_us
    joined = benchmark(replay, [((), {})], device=device, max_reps=100, joined_streams=True).median_us
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(200):
        replay()
    end.record()
    torch.cuda.synchronize()
    back_to_back = start.elapsed_time(end) * 1e3 / 200
    rows = []
    for way, us in (("synchronize, then end event", synced), ("end event after the replay", joined),
                    ("200 replays back to back", back_to_back)):  # fmt: skip
        rows.append(f"| {name} | {way} | {us:.1f} | {flops / (us * 1e-6) / 1e12:.0f} |")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count >= 20]
    for e in sorted(kernels, key=lambda e: -e.device_time_total):
        us = e.device_time_total / e.count
        rows.append(f"| {name} | kernel {e.key[:60]} (x{e.count // 20}) | {us:.1f} | |")
    return rows


def _resources(kernel) -> str:
    """Registers, spills and shared memory of each compiled variant of a Triton kernel."""
    found = []
    for cache in kernel.device_caches.values():
        for compiled in cache[0].values():
            meta = compiled.metadata
            found.append(
                f"{compiled.n_regs} regs, {compiled.n_spills} spills, {meta.shared // 1024} KiB shared, "
                f"{meta.num_warps} warps"
            )
    return "; ".join(found)


# Traced cases: (op, timing shape). The power-law jagged shape shows how the grid schedule fills
# the GPU when a few sequences are far longer than the rest.
TRACED = [
    ("target_attention", "r15-c70-s32-h2000-softmax"),
    ("target_attention", "r15-c70-s256-h2000-softmax"),
    ("jagged_attention", "b256-n4096-power-softmax"),
]


def trace(op: str, name: str, device: torch.device, traced: ModuleType, shift_last: bool) -> list[str]:
    problem = get_problem(op)
    shape = next(s for s in problem.timing_shapes if s.name == name)
    inputs = problem.make_inputs(shape, 1, device)
    heads = inputs.args[0].shape[-2]
    if op == "target_attention":
        options = sync_free_bounds(op, inputs.args, inputs.kwargs)
        rows = options["max_candidates"] * inputs.args[0].shape[1]
        causal = False
    else:
        options, rows, causal = {}, inputs.kwargs["max_seq_len"], inputs.kwargs["causal"]
    # Room for the grid of any query tile of 16 rows or more; programs that return at once (no
    # rows) leave their -1.
    programs = (inputs.args[3].numel() - 1) * triton.cdiv(rows, 16) * heads
    buf = torch.full((programs, len(FIELDS)), -1, dtype=torch.int64, device=device)
    traced.TRACE[0] = buf
    options |= {**inputs.kwargs, "shift_last": shift_last}
    launcher = f"{op}_forward"
    for _ in range(3):  # the last call's trace is kept (compiled and warm by then)
        buf.fill_(-1)
        out = getattr(traced, launcher)(*inputs.args, **options)
    torch.cuda.synchronize()
    ref = getattr(attention, launcher)(*inputs.args, **options)
    assert torch.equal(out, ref), "the traced kernel must compute what the kernel does"
    t = dict(zip(FIELDS, buf[buf[:, 0] >= 0].double().cpu().unbind(1), strict=True))
    t0 = t["start"].min()
    for f in FIELDS[:4]:
        t[f] = (t[f] - t0) / 1e3  # µs from the first program's start
    start, stop = t["start"], t["end"]
    span = float(stop.max())
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    dur = stop - start
    busy = float(dur.sum()) / (num_sms * span)
    # The tail: from the last program's start (after it, no program waits for an SM) to the end.
    last_start = float(start.max())
    tail_busy = float((stop.clamp(min=last_start) - start.clamp(min=last_start)).clamp(min=0).sum())
    tail_busy /= num_sms * (span - last_start)
    seen = torch.minimum((t["block"] + 1) * 128, t["n_k"]) if causal else t["n_k"]  # 128-row blocks
    tiles = torch.ceil(seen / 128)
    loops = t["loops_done"] - t["q_ready"]
    design = torch.stack([torch.ones_like(tiles), tiles], 1)
    fixed, per_tile = torch.linalg.lstsq(design, loops[:, None]).solution[:, 0].tolist()
    setup = float((t["q_ready"] - start).mean())
    epilogue = float((stop - t["loops_done"]).mean())
    used_sms = int(t["sm"].unique().numel())
    return [
        f"| {name} | {'shifted' if shift_last else 'masked loop'} "
        f"| {len(start)}, on {used_sms} SMs | {span:.1f} µs | {100 * busy:.0f}% "
        f"| {span - last_start:.1f} µs at {100 * tail_busy:.0f}% | {float(dur.mean()):.1f} µs | {setup:.2f} "
        f"| {fixed:.2f} + {per_tile:.3f} x {float(tiles.mean()):.1f} | {epilogue:.2f} |"
    ]


def host_time(device: torch.device, out_dir: Path) -> list[str]:
    _, _, inputs, bounds = _inputs(SHAPES[0], device)
    rows = []
    for label, options in (("eager, no bounds (one host sync)", {}), ("eager, bounds", bounds)):
        fn = partial(ops.target_attention, *inputs.args, **inputs.kwargs, **options)
        with torch.no_grad():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            host = (time.perf_counter() - t0) / 50 * 1e6
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 50 * 1e6
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(50):
                fn()
            profiler.disable()
            torch.cuda.synchronize()
        rows.append(f"| {label} | host {host:.0f} µs per call | with the GPU's work {wall:.0f} µs per call |")
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        pstats.Stats(profiler, stream=text).sort_stats("cumtime").print_stats(40)
        slug = "bounds" if options else "no_bounds"
        (out_dir / f"host_profile_{slug}.txt").write_text(text.getvalue())
        summary = io.StringIO()
        pstats.Stats(profiler, stream=summary).sort_stats("cumtime").print_stats(30)
        print(summary.getvalue()[-6000:], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=".", help="directory for the host profiles")
    args = parser.parse_args()
    out_dir = Path(args.out)
    device = torch.device("cuda")
    rows = ["| shape | timing | µs | TFLOP/s |", "|---|---|---|---|"]
    for name in SHAPES:
        rows += timing_ways(name, device)
    traced = traced_attention()
    rows += [
        "",
        "| shape | last key tile | programs | span | SMs busy | tail (busy) | program | set-up, q loaded "
        "| key tiles: fixed + per tile x tiles | epilogue |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for op, name in TRACED:
        for shift_last in (False, True):
            rows += trace(op, name, device, traced, shift_last)
    rows += ["", f"forward kernel: {_resources(attention._attn_fwd_kernel)}"]
    rows += [f"traced forward kernel: {_resources(traced._attn_fwd_kernel)}"]
    rows += ["", "| call | host | wall |", "|---|---|---|"]
    rows += host_time(device, out_dir)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
