"""Where embedding_bags_update's time goes at a timing shape: the numbering of the ids (keys, sort,
bags, chunk starts) by the kit's number_chunks beside the torch ops it replaced (checked equal
first), the op's kernels by the profiler, then the whole op at several launch knobs (an earlier
version's module first, if named), beside torch's sparse path. One CUDA device; rows print as
they are measured.

    python3 -m evals.studies.update_phases [SHAPE NAME SUBSTRING] [DTYPE] [EARLIER MODULE]
"""

from __future__ import annotations

import importlib
import sys

import torch
import triton
import triton.language as tl

import kernels.embedding_bags_update as kernel
import kernels.kit.embeddings as kit
from sandbox.timing import benchmark
from search_space import get_problem


def _compiled(fn) -> list[str]:
    """Registers, spills and shared memory of each compiled variant of a Triton kernel."""
    caches = getattr(fn, "device_caches", None)
    found = []
    if caches:
        for entry in caches.values():
            found.extend(entry[0].values())
    else:
        for entry in getattr(fn, "cache", {}).values():
            found.extend(entry.values())
    return [
        f"  {fn.__name__} {k.metadata.num_warps} warps: {k.n_regs} regs, {k.n_spills} spills, "
        f"{k.metadata.shared} B shared"
        for k in found
    ]


@triton.jit
def _chunk_end_starts_kernel(chunk_end_ptr, starts_ptr, nnz, BLOCK: tl.constexpr):
    """starts[c] = the first sorted position of chunk c (chunk_end: the inclusive count of chunk
    starts up to each position)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = pos < nnz
    ends = tl.load(chunk_end_ptr + pos, mask=valid, other=0)
    before = tl.load(chunk_end_ptr + pos - 1, mask=valid & (pos > 0), other=0)
    tl.store(starts_ptr + ends - 1, pos, mask=valid & (ends != before))


def torch_numbering(row_offsets, indices, offsets, batch, chunk, *, int32_keys):
    """number_chunks as it was before its kernels: every step but the chunk starts in torch ops
    (a search over all bags' ends, a chain of elementwise launches, a cumsum), the same outputs
    (an int64 bag; count an int32 view of chunk_end's last entry)."""
    nnz = indices.numel()
    positions = torch.arange(nnz, dtype=offsets.dtype, device=indices.device)
    bag = torch.searchsorted(offsets[1:], positions, right=True)
    keys = row_offsets[bag // batch] + indices
    if int32_keys:
        keys = keys.to(torch.int32)
    sorted_keys, order = torch.sort(keys, stable=True)
    flags = torch.ones(nnz, dtype=torch.int32, device=indices.device)
    flags[1:] = sorted_keys[1:] != sorted_keys[:-1]
    flags |= positions % chunk == 0
    chunk_end = torch.cumsum(flags, 0, dtype=torch.int32)
    starts = torch.full((nnz + 1,), nnz, dtype=torch.int64, device=indices.device)
    _chunk_end_starts_kernel[(triton.cdiv(nnz, 1024),)](chunk_end, starts, nnz, BLOCK=1024)
    return bag, sorted_keys, order, starts, chunk_end[nnz - 1 :]


def _row(name: str, us: float) -> None:
    """One row of the table, printed as it comes: a run cut short keeps what it measured."""
    print(f"{name:75} {us:10.1f} us", flush=True)


def main(pattern: str = "b64k-20f-short", dtype: str = "bf16", earlier: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    shape = next(s for s in problem.timing_shapes if pattern in s.name and s.dtype == dtype)
    inputs = problem.make_inputs(shape, 1, device)
    weights, state, grad_out, w_off, r_off, d_off, indices, offsets = inputs.args
    nnz, batch = indices.numel(), (offsets.numel() - 1) // w_off.numel()
    print(f"{shape.describe()}: {nnz:,} ids")

    int32_keys = max(weights.numel(), state.numel()) < kernel.INT32_KEYS_BELOW
    numbering = ((r_off, indices, offsets, batch, kernel.KNOBS["CHUNK"]), {"int32_keys": int32_keys})
    ours = kit.number_chunks(*numbering[0], **numbering[1])
    before = torch_numbering(*numbering[0], **numbering[1])
    for name, new, old in zip(("bag", "sorted_keys", "order", "starts", "count"), ours, before, strict=True):
        assert torch.equal(new.long(), old.long()), f"number_chunks and torch_numbering differ in {name}"
    del ours, before

    def stats(fn, args=((), {})):
        return benchmark(fn, [args], device=device, max_reps=20).median_us

    _row("numbering: number_chunks", stats(kit.number_chunks, numbering))
    _row("numbering before: torch_numbering", stats(torch_numbering, numbering))
    # The kernels alone (the rest is host work), by the profiler.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            kernel.embedding_bags_update(*inputs.args, **inputs.kwargs)
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            _row(f"device: {event.key[:66]}", event.self_device_time_total / 3)
    versions = [("", kernel)]
    if earlier:  # an earlier version's module beside this one, for a side-by-side run (first)
        versions.insert(0, (earlier + " ", importlib.import_module(earlier)))
    # (BLOCK_I, BLOCK_L, BLOCK_D, num_warps[, VECTORS]); None keeps the launch heuristic's, and
    # VECTORS False moves rows an element at a time (as before 16-byte vectors).
    configs = [(None,) * 4, (None, None, None, None, False), (2, 1, 128, 1), (1, 1, 256, 1), (2, 1, 256, 2)]
    configs += [(4, 1, 128, 2), (1, 1, 128, 1), (2, 1, 64, 1), (4, 1, 64, 2), (2, 1, 32, 1), (8, 1, 32, 2)]
    for label, module in versions:
        base = dict(module.KNOBS)
        for config in configs if not label else configs[:2]:
            names = ("BLOCK_I", "BLOCK_L", "BLOCK_D", "num_warps", "VECTORS")
            knobs = dict(zip(names, config, strict=False))
            module.VECTORS = knobs.get("VECTORS", True)
            module.KNOBS.update(base, **{k: v for k, v in knobs.items() if k in base})
            us = stats(module.embedding_bags_update, (inputs.args, inputs.kwargs))
            _row(f"{label}whole op, {' '.join(f'{k}={v}' for k, v in knobs.items())}", us)
        module.KNOBS.update(base)
        module.VECTORS = True
        for what in _compiled(module._rows_kernel):
            print(f"{label}{what}")
    _row(
        "torch.embedding_bag_sparse+step",
        stats(problem.baselines["torch.embedding_bag_sparse+step"], (inputs.args, inputs.kwargs)),
    )
    print(triton.__version__, torch.__version__)


if __name__ == "__main__":
    main(*sys.argv[1:])
