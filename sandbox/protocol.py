"""The evaluation protocol, in one place for every backend: what a candidate must satisfy to be
called correct. The judge (sandbox.judge) enforces it; this module holds the comparison and the
request, and imports no candidate code.

Rules of closeness (each enforced below, where it is written):
- the output has the reference's exact structure: one tensor, or a tuple of as many tensors (a
  backward's gradients), each of the reference's shape, dtype and device;
- element-wise, closeness is relative to the output's magnitude (see `Tolerance`), so zeros do
  not pass on small outputs, and NaN or inf where the reference is finite fails;
- as a whole, the relative error norm is bounded;
- per row (a bag, a token, a candidate: the output's first dimension), the error norm is bounded
  relative to that row's own norm plus a floor from the dtype's rounding (Tolerance.row_rtol and
  row_atol), so a few zeroed rows, or outputs rounded to a grid as coarse as the element
  tolerance, fail even where every element is inside its bound;
- integer and boolean outputs are exact; complex outputs are refused.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import torch
from pydantic import BaseModel

from sandbox.poison import poison
from sandbox.result import ShapeCheck
from search_space.problem import Inputs, Problem, Shape, Tolerance

# Beside the judge's result file: when its evaluation's deadline now falls, in wall-clock seconds
# since the epoch, written each time a wait for the GPU's lock moves it (sandbox.judge.Deadline).
DEADLINE_MARK = "deadline"


class EvalRequest(BaseModel):
    """What a backend asks a judge to do with one candidate."""

    problem: str
    candidate_id: str
    source_file: str  # as the runner sees it
    entry: str
    check: bool = True
    trials: int = 2  # at least two are run: see judge.Evaluation.run_checks
    timing: bool = True
    baselines: list[str] = []  # names among "reference", "reference.compile", problem baselines
    # Device kinds (DeviceInfo.kind) on which the caller holds these baselines already: a judge on
    # one of them times none. A campaign cannot know which kind a task lands on (a Ray cluster of
    # several GPU models), so the judge, which knows its own, decides.
    baselines_held_on: list[str] = []
    # Where the judges of one call, run side by side, decide which times the baselines on each kind
    # of device (sandbox.locks.BaselineClaims): a directory on the judges' host, or None for a
    # judge that times them wherever they are not held.
    baselines_claims: str | None = None
    input_sets: int = 3  # for the baselines, which the judge times in its own process
    # The timing lock files of the GPUs the evaluation may use, one per GPU (sandbox.locks.gpu_use):
    # evaluations check and compile side by side under shared locks, and one at a time measures a
    # GPU under an exclusive one, with nothing beside. Empty: unlocked.
    timing_locks: list[str] = []
    # The one GPU the evaluation runs on, as CUDA_VISIBLE_DEVICES names it (sandbox.gpus): the
    # judge sets that variable to it before CUDA starts, and its runner inherits it. None: the
    # GPUs of the judge's environment.
    gpu: str | None = None
    # The UUID of `gpu` as the backend found it (sandbox.gpus.gpu_uuids): the judge refuses to
    # run on a GPU that is another, whose locks it would not hold. None: not known.
    gpu_uuid: str | None = None
    # The device node (minor number) of `gpu` where the backend found that a runner sandboxed
    # with it alone sees that GPU (sandbox.isolation.one_gpu_sandbox_works, asked once per GPU by
    # the backend); None: the judge asks itself. The judge gives the runner that node alone only
    # where it is its own GPU's.
    gpu_node: int | None = None
    # The CPU cores the judge and its runner run on (sandbox.gpus.split_cpus: a GPU place's
    # own), set by the judge on itself before anything starts; None: every core it may use.
    cpus: list[int] | None = None
    # The runner's scratch directory (its only writable place) and how it is isolated.
    runner_dir: str = ""
    isolation: str = "bwrap"
    timeout_s: float = 300.0  # the whole evaluation, from the judge's start
    # Inputs of one timed batch live in one shared region, and the batch's calls hold their
    # outputs and the runner's poison before them: at most this many bytes in all (at least one
    # call's), each timed call with inputs of its own.
    region_budget_bytes: int = 8 * 1024**3
    # Applied by the runner to itself before the candidate is imported (None: not set here).
    cpu_seconds: int | None = None
    address_space_bytes: int | None = None
    # The most device memory the runner's allocator may hold (torch's per-process fraction, set
    # before the candidate is imported; the shared input regions, the judge's, do not count):
    # evaluations share one GPU, and a candidate that takes all of it would fail the others.
    gpu_memory_bytes: int | None = 32 * 1024**3
    # What the runner may hold in its scratch directory, watched by the judge (None: unwatched).
    scratch_bytes: int | None = 4 * 1024**3
    scratch_files: int | None = 100_000
    # With isolation "docker": the container's settings (sandbox.docker_backend.ContainerRunner).
    docker: dict | None = None


def all_baselines(problem: Problem) -> list[str]:
    """Every baseline a worker can time for `problem`: its reference (fp32, or fp64 where the
    problem's oracle needs it), torch.compile of it (GPU only) and the problem's eager PyTorch
    ops."""
    return ["reference", "reference.compile", *problem.baselines]


def campaign_baselines(problem: Problem) -> list[str]:
    """The baselines a campaign times by default: the problem's choice, else all of them."""
    if problem.campaign_baselines is not None:
        return list(problem.campaign_baselines)
    return all_baselines(problem)


def fresh_seed() -> int:
    return secrets.randbits(62)


def _storages(inputs: Inputs) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in inputs.tensors() if t.numel() > 0}


Output = torch.Tensor | tuple[torch.Tensor, ...]


def output_tensors(out: object) -> list[torch.Tensor]:
    """The tensors of an output: one, or each of a tuple (a backward's gradients)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple | list):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def _nbytes(out: Output) -> int:
    return sum(t.numel() * t.element_size() for t in output_tensors(out))


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    """The index in `shape` of element `flat` of its row-major flattening (torch.unravel_index
    does the same, but its first call imports sympy: a second of every judge's CPU time)."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size) if size else (flat, 0)
        index.append(i)
    return index[::-1]


def compare(
    out: object,
    ref: Output,
    tol: Tolerance | tuple[Tolerance, ...],
    scale: float | None | tuple[float | None, ...] = None,
) -> tuple[bool, dict]:
    """Closeness of `out` to `ref` under `tol`; the details say where and by how much. atol is
    relative to the reference's RMS, or to `scale` where that is larger (a problem's error
    scale: the magnitude its rounding errors come with). A tuple reference (several outputs,
    such as gradients) needs a tuple of as many tensors, each close: under `tol` and `scale`,
    or where those are tuples (Problem.closeness), under its own. Where the reference is not
    finite (the -inf log-sum-exp of a row with no key) the output must equal it."""
    if isinstance(ref, tuple):
        if not isinstance(out, tuple | list) or len(out) != len(ref):
            got = f"{len(out)} values" if isinstance(out, tuple | list) else type(out).__name__
            return False, {"message": f"returned {got}, expected a tuple of {len(ref)} tensors"}
        tols = tol if isinstance(tol, tuple) else (tol,) * len(ref)
        scales = scale if isinstance(scale, tuple) else (scale,) * len(ref)
        if len(tols) != len(ref) or len(scales) != len(ref):
            raise ValueError(f"{len(tols)} tolerances and {len(scales)} scales for {len(ref)} outputs")
        for i, (o, r, t, sc) in enumerate(zip(out, ref, tols, scales, strict=True)):
            ok, details = compare(o, r, t, sc)
            if not ok:
                return False, {**details, "message": f"output {i}: {details['message']}"}
        return True, {}
    if isinstance(tol, tuple) or isinstance(scale, tuple):
        return False, {"message": f"returned {type(out).__name__}, expected a tuple of {len(tol)} tensors"}
    return _compare_tensor(out, ref, tol, scale)


# Rows compared at a time, as many as hold this many elements (one row at least): each step's fp64
# temporaries are a few of 512 MB whatever the output's size. Whole at once, a dense gradient of a
# 2^31-element table took three 17 GB copies, and a judge comparing an updated table beside
# another evaluation ran an 80 GB H100 out of memory.
COMPARE_CHUNK_ELEMENTS = 1 << 26


def _row_chunks(ref: torch.Tensor) -> Iterator[tuple[int, int]]:
    """(first row, end row) of each step of the comparison: whole rows of ref's first dim."""
    width = max(ref.numel() // ref.shape[0], 1)
    step = max(COMPARE_CHUNK_ELEMENTS // width, 1)
    for a in range(0, ref.shape[0], step):
        yield a, min(a + step, ref.shape[0])


def _compare_tensor(
    out: object, ref: torch.Tensor, tol: Tolerance, scale: float | None = None
) -> tuple[bool, dict]:
    if not isinstance(out, torch.Tensor):
        return False, {"message": f"returned {type(out).__name__}, expected a Tensor"}
    if out.shape != ref.shape or out.dtype != ref.dtype or out.device != ref.device:
        return False, {
            "message": f"returned {tuple(out.shape)} {out.dtype} on {out.device}, expected "
            f"{tuple(ref.shape)} {ref.dtype} on {ref.device}"
        }
    if ref.numel() == 0:
        return True, {}
    shape = tuple(ref.shape)
    if ref.is_complex():  # fp64 would drop the imaginary part
        return False, {"message": f"a {ref.dtype} output: complex outputs are not compared"}
    if not ref.is_floating_point():
        # Integers (ids, counts) and booleans are exact, and int64 past 2^53 has no fp64 twin.
        unequal = out != ref
        if not bool(unequal.any()):
            return True, {"max_abs_err": 0.0, "norm_rel_err": 0.0, "worst_index": _unravel(0, shape)}
        where = _unravel(int(unequal.flatten().nonzero()[0]), shape)
        return False, {
            "message": f"{int(unequal.sum())} of {ref.numel()} elements differ from the exact "
            f"{ref.dtype} reference; first at {where}: got {out[tuple(where)].item()}, expected "
            f"{ref[tuple(where)].item()}",
            "worst_index": where,
        }
    out_rows, ref_rows = (out.reshape(1), ref.reshape(1)) if ref.dim() == 0 else (out, ref)
    width = max(ref.numel() // ref_rows.shape[0], 1)
    chunks = list(_row_chunks(ref_rows))

    def fp64(rows: torch.Tensor, a: int, b: int) -> torch.Tensor:
        copy = rows[a:b].to(torch.float64, memory_format=torch.contiguous_format, copy=True)
        return copy.reshape(b - a, -1)

    def pair(a: int, b: int, *, out_too: bool = True) -> tuple:
        """Rows a:b of both in fp64, flat per row (the output's only where `out_too` or needed);
        a non-finite reference element must be equal in the output, and then both count as 0
        (exact). Also returns the masks of the non-finite reference elements and of those the
        output differs at (None where the rows have none)."""
        r = fp64(ref_rows, a, b)
        infinite = ~torch.isfinite(r)
        if not bool(infinite.any()):
            return fp64(out_rows, a, b) if out_too else None, r, None, None
        o = fp64(out_rows, a, b)
        unequal = infinite & ~(o == r)
        o.masked_fill_(infinite, 0.0)
        r.masked_fill_(infinite, 0.0)
        return o, r, infinite, unequal

    # First pass: the non-finite reference elements, and the reference's norm (its RMS sets the
    # element bounds' floor, so it comes before any bound). An output of one step (most are) is
    # converted once, for both passes.
    whole = pair(*chunks[0]) if len(chunks) == 1 else None
    ref_sq, n_infinite, n_unequal, first_unequal = 0.0, 0, 0, None
    for a, b in chunks:
        o, r, infinite, unequal = whole or pair(a, b, out_too=False)
        ref_sq += float(r.square().sum())
        if infinite is not None:
            n_infinite += int(infinite.sum())
            n_unequal += int(unequal.sum())
            if first_unequal is None and bool(unequal.any()):
                first_unequal = a * width + int(unequal.flatten().nonzero()[0])
        del o, r, infinite, unequal
    if first_unequal is not None:
        where = _unravel(first_unequal, shape)
        return False, {
            "message": f"{n_unequal} of {n_infinite} non-finite reference elements differ; first at "
            f"{where}: got {float(out[tuple(where)]):.6g}, expected {float(ref[tuple(where)]):.6g}",
            "worst_index": where,
        }
    ref_norm = ref_sq**0.5
    scale = max(ref_norm / ref.numel() ** 0.5, scale or 0.0, 1e-6)
    rows_check = ref.dim() >= 1 and (tol.row_rtol is not None or tol.row_atol is not None)
    row_floor = (tol.row_atol or 0.0) * scale * width**0.5
    # Second pass: each element against its bound, the error's norm, each row's error norm
    # against its own bound (a NaN counts as an infinite error throughout).
    err_sq, n_bad, worst, worst_err = 0.0, 0, 0, -1.0
    n_bad_rows, worst_row, worst_ratio, worst_row_of = 0, 0, -1.0, (0.0, 0.0, 0.0)
    for a, b in chunks:
        diff, r, _, _ = whole or pair(a, b)
        diff.sub_(r)  # the signed error
        err_sq += float(diff.square().sum())
        diff.abs_()
        bound = r.abs().mul_(tol.rtol).add_(tol.atol * scale)
        n_bad += int((~(diff <= bound)).sum())  # NaN compares false, so NaN counts as bad
        del bound
        if rows_check:
            rows_err = torch.linalg.vector_norm(diff, dim=1)
            rows_ref = torch.linalg.vector_norm(r, dim=1)
            row_bound = (tol.row_rtol or 0.0) * rows_ref + row_floor
            bad_rows = ~(rows_err <= row_bound)
            if bool(bad_rows.any()):
                n_bad_rows += int(bad_rows.sum())
                inf = torch.full_like(rows_err, float("inf"))
                ratio = torch.where(row_bound > 0, rows_err / row_bound, inf).nan_to_num_(nan=float("inf"))
                ratio = torch.where(bad_rows, ratio, -1.0)  # the worst of the rows out of bounds
                i = int(ratio.argmax())
                if float(ratio[i]) > worst_ratio:
                    worst_ratio, worst_row = float(ratio[i]), a + i
                    worst_row_of = (rows_err[i].item(), rows_ref[i].item(), row_bound[i].item())
        diff.nan_to_num_(nan=float("inf"))
        i = int(diff.argmax())
        if float(diff.flatten()[i]) > worst_err:
            worst, worst_err = a * width + i, float(diff.flatten()[i])
        del diff, r
    norm_rel = err_sq**0.5 / max(ref_norm, 1e-12)
    worst_index = _unravel(worst, shape)
    details = {
        "max_abs_err": worst_err,
        "norm_rel_err": norm_rel,
        "worst_index": [int(i) for i in worst_index],
    }
    if n_bad:
        details["message"] = (
            f"{n_bad} of {ref.numel()} elements outside tolerance; worst at "
            f"{details['worst_index']}: got {float(out[tuple(worst_index)]):.6g}, "
            f"expected {float(ref[tuple(worst_index)]):.6g}"
        )
        return False, details
    # Against an all-zero reference (dq of one-key softmax rows) there is no relative norm: the
    # element-wise bound above, relative to the problem's error scale, is the test.
    if ref_norm > 0 and not norm_rel <= tol.norm_rtol:
        details["message"] = f"relative error norm {norm_rel:.3g} exceeds {tol.norm_rtol:.3g}"
        return False, details
    # Rule rows: each row's error norm against its own norm, plus the dtype's floor.
    if n_bad_rows:
        err, norm, bound = worst_row_of
        details["message"] = (
            f"{n_bad_rows} of {ref.shape[0]} rows outside their norm bound; worst row "
            f"{worst_row}: error norm {err:.3g} against its norm {norm:.3g} (bound {bound:.3g})"
        )
        return False, details
    return True, details


def _call(problem: Problem, fn: Callable, inputs: Inputs, device: torch.device, out_bytes: int) -> tuple:
    """(what the call computed, None), or (None, what is wrong with what it returned): an op that
    updates its arguments returns None (Problem.result)."""
    poison(device, 2 * out_bytes + (1 << 20))
    out = fn(*inputs.args, **inputs.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if problem.updates and out is not None:
        return None, f"returned {type(out).__name__}; an op that updates its arguments in place returns None"
    return problem.result(inputs, out), None


def check_shape(
    problem: Problem,
    fn: Callable,
    shape: Shape,
    trial: int,
    device: torch.device,
    *,
    repeat: bool = False,
    held: list[torch.Tensor] | None = None,
) -> ShapeCheck:
    """Run one correctness trial of `fn` on fresh inputs of `shape` (twice with `repeat`, to
    check that it agrees with itself), in this process: for the library's own, trusted kernels
    (tests of problems and kernels); candidates are checked by the judge, never so. `held` keeps
    earlier outputs alive, so an output that shares their memory is a buffer the candidate
    reuses, not a fresh allocation. Exceptions propagate."""
    inputs = problem.make_inputs(shape, fresh_seed(), device)
    pristine = inputs.clone()
    ref_inputs = pristine.clone()  # the reference gets its own copy: it may not see the candidate's
    ref = problem.result(ref_inputs, problem.reference(*ref_inputs.args, **ref_inputs.kwargs))
    base = {"shape": shape.name, "dtype": shape.dtype, "trial": trial}
    out, problem_with_it = _call(problem, fn, inputs, device, _nbytes(ref))
    if problem_with_it:
        return ShapeCheck(**base, ok=False, message=problem_with_it)
    updated = problem.updated(inputs)
    for got, want, updates in zip(inputs.tensors(), pristine.tensors(), updated, strict=True):
        if not updates and not torch.equal(got, want):
            return ShapeCheck(**base, ok=False, message="the candidate modified its inputs")
    if not problem.updates:  # an update's outputs are its arguments
        input_storages = _storages(inputs)
        seen: set[int] = {h.untyped_storage().data_ptr() for h in held or ()}
        for tensor in output_tensors(out):
            if tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage().data_ptr()
            if storage in input_storages:
                return ShapeCheck(**base, ok=False, message="the output shares memory with an input")
            if storage in seen:
                return ShapeCheck(**base, ok=False, message="the output shares memory with an earlier output")
            seen.add(storage)
            if held is not None:
                held.append(tensor)
    tol, scale = problem.closeness(shape.dtype, pristine, ref)
    ok, details = compare(out, ref, tol, scale)
    wrong = problem.verify(pristine, out) if ok and problem.verify is not None else None
    if wrong is not None:
        return ShapeCheck(**base, ok=False, **{**details, "message": wrong})
    if ok and repeat:
        # An update runs again on its own copy of the same inputs; any other call on the same ones.
        again = pristine.clone() if problem.updates else inputs
        second, problem_with_it = _call(problem, fn, again, device, _nbytes(ref))
        if problem_with_it:
            return ShapeCheck(**base, ok=False, message=problem_with_it)
        first_storages = {t.untyped_storage().data_ptr() for t in output_tensors(out) if t.numel() > 0}
        if not problem.updates and any(
            t.numel() > 0 and t.untyped_storage().data_ptr() in first_storages for t in output_tensors(second)
        ):
            return ShapeCheck(**base, ok=False, message="the output shares memory with an earlier output")
        again_ok, _ = compare(second, out, tol, scale)
        if not again_ok:
            return ShapeCheck(
                **base,
                ok=False,
                message="two runs on the same inputs disagree",
                **{k: v for k, v in details.items() if k != "message"},
            )
    return ShapeCheck(**base, ok=ok, **details)
