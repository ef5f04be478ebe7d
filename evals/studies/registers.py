"""Registers, spills and 16-byte vector accesses of the embedding kernels' launch tiles, compiled
for an H100/H200 (sm_90) by Triton's real compiler on any machine, GPU or not: a tile's
registers bound how many of its programs an SM holds (65536 registers an SM), and so how many
random row gathers are in flight at once. Pointer arguments are taken as 16-byte aligned, as a
launch on a GPU specializes them.

    python3 -m evals.studies.registers

Each row: the kernel, its tile, registers a thread and spilled bytes (ptxas -v), the programs
an SM holds (by registers, at most 32 programs and 64 warps), the vector loads and stores in
its PTX, and the registers of the same kernel without its misaligned path (aligned_only): a
kernel holds its costlier path's registers. The counts are this Triton's: another version's
compiler allocates differently. For the GPU hosts' Triton on a CPU host (it reproduced the 166
registers ncu counted for the short bf16 lookup on an H100, where Triton 3.9 gives 128):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:$PWD python3 -m evals.studies.registers
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.embedding_bags as lookup
import kernels.embedding_bags_backward as backward
import kernels.embedding_bags_update as update
from evals.studies import module_from_source

TARGET = GPUTarget("cuda", 90, 32)
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) of the PTX's kernel, by the first ptxas of Triton's that
    takes its PTX version."""
    with tempfile.TemporaryDirectory() as where:
        src = Path(where) / "k.ptx"
        src.write_text(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            done = subprocess.run(
                [str(_BIN / name), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(src.with_suffix(".o"))],
                capture_output=True,
                text=True,
            )
            regs = re.search(r"Used (\d+) registers", done.stderr)
            if done.returncode == 0 and regs:
                spill = re.search(r"(\d+) bytes spill stores", done.stderr)
                return int(regs.group(1)), int(spill.group(1)) if spill else 0
    raise RuntimeError("no ptxas of Triton's took this PTX")


def compile_report(fn, types: dict, constexprs: dict, warps: int) -> tuple[int, int, int]:
    """(registers, spill bytes, vector loads and stores) of fn at these constexprs."""
    names = fn.arg_names
    default = {True: "*i64", False: "i32"}  # by whether the name ends in _ptr
    signature = {
        n: "constexpr" if n in constexprs else types.get(n, default[n.endswith("_ptr")]) for n in names
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=TARGET, options={"num_warps": warps, "num_stages": 1})
    ptx = kernel.asm["ptx"]
    regs, spill = _ptxas_report(ptx)
    return regs, spill, len(re.findall(r"\b(?:ld|st)\.global[\w.:]*\.v[24]\.", ptx))


# Each module's tests of alignment, whose other branch moves rows an element at a time.
ALIGNED_BRANCHES = {
    lookup: (
        "    if rows & (first_col % VEC == 0) & (stride_out_row % VEC == 0):  # always where VEC is 1\n",
    ),
    backward: ("    if aligned:  # always, where VEC is 1\n",),
    update: ("    if misaligned == 0:\n",),
}


def aligned_only(module):
    """A copy of `module` (a key of ALIGNED_BRANCHES) whose kernels always take the aligned path:
    the misaligned path compiled out."""
    source = Path(module.__file__).read_text()
    for branch in ALIGNED_BRANCHES[module]:
        if source.count(branch) != 1:
            raise ValueError(f"{module.__name__}: an alignment test is not once in its source: {branch!r}")
        source = source.replace(branch, "    if True:\n")
    return module_from_source(source, module.__name__.rsplit(".", 1)[-1] + "_aligned_only")


def lookup_launch(element_size: int, mean_ids: float) -> tuple[dict, int]:
    """The forward's constexprs and warps as its launch picks them on a GPU, for a call of
    `mean_ids` ids a bag (up to 32 features of up to 64 columns, sums, no per-sample weights;
    rows of 32-byte multiples; registers uncapped, whatever its maxnreg)."""
    cfg = lookup._forward_config(64, element_size, mean_ids)
    vec = 16 // element_size
    constexprs = {k: cfg[k] for k in ("BLOCK_B", "BLOCK_L", "BLOCK_D", "ACC_3D", "FLAT", "SLICES_TOGETHER")}
    constexprs |= dict(HAS_PSW=False, MODE_MEAN=False, FEATURES=32, EVICT_ROWS="", NUM_STAGES=1, VEC=vec)
    constexprs["BAGS_MAJOR"] = False  # the launch's for rows of 32-byte multiples
    constexprs["SLICE_D"] = lookup._slice_d(cfg, vec, element_size)
    return constexprs, cfg["num_warps"]


def backward_launch(element_size: int) -> tuple[dict, int]:
    """The backward's constexprs and warps as its launch picks them on a GPU (sums, no weights)."""
    cfg = backward._backward_config(256)
    constexprs = dict(HAS_PSW=False, MODE_MEAN=False, BLOCK_L=cfg["BLOCK_L"], BLOCK_D=cfg["BLOCK_D"])
    constexprs |= dict(VEC=16 // element_size, SLICE_D=max(cfg["BLOCK_D"] // 4, 1))  # as the launch's
    return constexprs, cfg["num_warps"]


def _update_tiles() -> Iterator[tuple[str, dict, int]]:
    flags = dict(ADAGRAD=True, SCALED=False, STOCHASTIC=False, CHUNK=64, VEC=8, HALF=4)
    for i, d, w in [(8, 32, 2), (16, 32, 2), (32, 32, 4), (16, 64, 2), (8, 256, 4)]:
        tile = {"BLOCK_I": i, "BLOCK_L": 1, "BLOCK_D": d, "SLICE_D": d // 4}  # as the launch's
        yield f"update rows {i}x1x{d} w{w}", {**flags, **tile}, w


def _lookup_tiles() -> Iterator[tuple[str, dict, int]]:
    flags = dict(
        HAS_PSW=False, MODE_MEAN=False, FEATURES=32, ACC_3D=False, EVICT_ROWS="", NUM_STAGES=1, VEC=8
    )
    flags |= dict(FLAT=False, SLICES_TOGETHER=False, BAGS_MAJOR=False)
    for b, ids, d, w in [(64, 1, 64, 2), (64, 1, 64, 4), (32, 1, 64, 2), (16, 1, 64, 1), (32, 2, 64, 2)]:
        tile = {"BLOCK_B": b, "BLOCK_L": ids, "BLOCK_D": d, "SLICE_D": d // flags["VEC"]}
        yield f"lookup fwd {b}x{ids}x{d} w{w}", {**flags, **tile}, w


def _backward_tiles() -> Iterator[tuple[str, dict, int]]:
    flags = dict(HAS_PSW=False, MODE_MEAN=False, VEC=8)
    for ids, d, w in [(16, 128, 4)]:
        yield f"lookup bwd {ids}x{d} w{w}", {**flags, "BLOCK_L": ids, "BLOCK_D": d, "SLICE_D": d // 4}, w


UPDATE_TYPES = dict(
    weights_ptr="*bf16", state_ptr="*fp32", grad_out_ptr="*bf16", grad_at_ptr="*i32", scale_ptr="*fp32",
    c_key_ptr="*i32", c_row_at_ptr="*i32", c_dim_ptr="*i32", c_grad_at_ptr="*i32", c_scale_ptr="*fp32",
    partial_ptr="*fp32", lr="fp32", eps="fp32", misaligned_ptr="*i32",
)  # fmt: skip
LOOKUP_TYPES = {n: "*i64" for n in ("weight_offsets_ptr", "dim_offsets_ptr", "indices_ptr", "offsets_ptr")}
LOOKUP_TYPES |= {"weights_ptr": "*bf16", "psw_ptr": "*bf16", "out_ptr": "*bf16"}
LOOKUP_TYPES |= {
    n: "i32" for n in ("stride_out_row", "num_bags", "num_bag_blocks", "num_blocks", "num_features")
}
BACKWARD_TYPES = LOOKUP_TYPES | {"grad_out_ptr": "*bf16", "grad_ptr": "*fp32"}


def main() -> None:
    print(f"triton {triton.__version__}, sm_90")
    head = f"{'regs':>5} {'spill':>6} {'programs/SM':>12} {'vector ops':>11} {'aligned path alone':>19}"
    print(f"{'kernel and tile (bf16)':34} {head}")
    alone_of = {module: aligned_only(module) for module in (update, lookup, backward)}
    for module, kernel, types, tiles in (
        (update, "_rows_kernel", UPDATE_TYPES, _update_tiles()),
        (lookup, "_embedding_bags_fwd_kernel", LOOKUP_TYPES, _lookup_tiles()),
        (backward, "_embedding_bags_bwd_kernel", BACKWARD_TYPES, _backward_tiles()),
    ):
        alone = alone_of[module]
        for label, constexprs, warps in tiles:
            regs, spill, vectors = compile_report(getattr(module, kernel), types, constexprs, warps)
            programs = min(32, 64 // warps, 65536 // (regs * 32 * warps))  # blocks, warps, registers
            aligned, aligned_spill = compile_report(getattr(alone, kernel), types, constexprs, warps)[:2]
            alone_row = f"{aligned} ({aligned_spill} spilled)"
            print(f"{label:34} {regs:5} {spill:6} {programs:12} {vectors:11} {alone_row:>19}", flush=True)


if __name__ == "__main__":
    main()
