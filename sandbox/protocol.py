"""The evaluation protocol, in one place for every backend: what a candidate must satisfy to be
called correct, and how it is timed.

Rules (each enforced below, where it is written):
- inputs are generated here with seeds drawn from the OS, fresh for every trial, after the
  candidate is imported, so it cannot know them;
- the reference runs on its own clones of the inputs;
- the candidate must leave its inputs unchanged;
- its output must be a new tensor (no storage shared with an input, an earlier output or
  another of its outputs) of the reference's exact shape, dtype and device; a problem whose
  reference returns a tuple (a backward: one gradient per differentiable input) gets each
  element checked so;
- memory the candidate may allocate from is poisoned with NaN first, so an element it never
  writes fails the comparison;
- closeness is judged relative to the output's magnitude (see `Tolerance`), so zeros do not
  pass on small outputs, and NaN or inf where the reference is finite fails;
- run twice on the same inputs, the candidate must agree with itself within the tolerance
  (non-determinism beyond rounding fails);
- with every Triton kernel launch turned into a no-op, its output must no longer be correct:
  otherwise the work was done by something other than its kernels.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from functools import partial

import torch
from pydantic import BaseModel

from sandbox.result import ShapeCheck
from search_space.problem import Inputs, Problem, Shape, Tolerance

POISON_BYTE = 0xFF  # all-ones is NaN in fp16, bf16, fp32 and fp64


class EvalRequest(BaseModel):
    """What the parent asks a worker to do with one candidate."""

    problem: str
    candidate_id: str
    source_file: str
    entry: str
    check: bool = True
    trials: int = 2  # at least two are run: see worker.evaluate
    timing: bool = True
    baselines: list[str] = []  # names among "reference", "reference.compile", problem baselines
    input_sets: int = 3
    # The GPU's lock file (worker.gpu_use): workers check and compile side by side under a shared
    # lock, and one at a time measures the GPU under an exclusive one, with no check beside it.
    timing_lock: str | None = None
    # Applied by the worker to itself before the candidate is imported (None: not set here).
    cpu_seconds: int | None = None
    address_space_bytes: int | None = None


def all_baselines(problem: Problem) -> list[str]:
    """Every baseline a worker can time for `problem`: the fp32 reference, torch.compile of it
    (GPU only) and the problem's eager PyTorch ops."""
    return ["reference", "reference.compile", *problem.baselines]


def campaign_baselines(problem: Problem) -> list[str]:
    """The baselines a campaign times by default: the problem's choice, else all of them."""
    if problem.campaign_baselines is not None:
        return list(problem.campaign_baselines)
    return all_baselines(problem)


def fresh_seed() -> int:
    return secrets.randbits(62)


def poison_allocator(device: torch.device, nbytes: int) -> None:
    """Fill memory the next allocations are likely to reuse with NaN bytes.

    On CUDA the caching allocator hands a freed block to the next request of a similar size,
    so a block filled and freed here is what `torch.empty` in the candidate returns."""
    if nbytes <= 0:
        return
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    block.fill_(POISON_BYTE)
    del block


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


def compare(out: object, ref: Output, tol: Tolerance, scale: float | None = None) -> tuple[bool, dict]:
    """Closeness of `out` to `ref` under `tol`; the details say where and by how much. atol is
    relative to the reference's RMS, or to `scale` where that is larger (a problem's error
    scale: the magnitude its rounding errors come with). A tuple reference (several outputs,
    such as gradients) needs a tuple of as many tensors, each close."""
    if isinstance(ref, tuple):
        if not isinstance(out, tuple | list) or len(out) != len(ref):
            got = f"{len(out)} values" if isinstance(out, tuple | list) else type(out).__name__
            return False, {"message": f"returned {got}, expected a tuple of {len(ref)} tensors"}
        for i, (o, r) in enumerate(zip(out, ref, strict=True)):
            ok, details = compare(o, r, tol, scale)
            if not ok:
                return False, {**details, "message": f"output {i}: {details['message']}"}
        return True, {}
    return _compare_tensor(out, ref, tol, scale)


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
    out64, ref64 = out.double(), ref.double()
    diff = (out64 - ref64).abs()
    rms = ref64.pow(2).mean().sqrt().item()
    scale = max(rms, scale or 0.0, 1e-6)
    bound = tol.atol * scale + tol.rtol * ref64.abs()
    bad = ~(diff <= bound)  # NaN compares false, so NaN counts as bad
    ref_norm = ref64.norm().item()
    norm_rel = ((out64 - ref64).norm() / max(ref_norm, 1e-12)).item()
    worst = int(torch.nan_to_num(diff, nan=float("inf")).argmax())
    worst_index = list(torch.unravel_index(torch.tensor(worst), ref.shape))
    details = {
        "max_abs_err": float(torch.nan_to_num(diff, nan=float("inf")).max()),
        "norm_rel_err": norm_rel,
        "worst_index": [int(i) for i in worst_index],
    }
    if bad.any():
        n_bad = int(bad.sum())
        details["message"] = (
            f"{n_bad} of {ref.numel()} elements outside tolerance; worst at "
            f"{details['worst_index']}: got {out64.flatten()[worst].item():.6g}, "
            f"expected {ref64.flatten()[worst].item():.6g}"
        )
        return False, details
    # Against an all-zero reference (dq of one-key softmax rows) there is no relative norm: the
    # element-wise bound above, relative to the problem's error scale, is the test.
    if ref_norm > 0 and not norm_rel <= tol.norm_rtol:
        details["message"] = f"relative error norm {norm_rel:.3g} exceeds {tol.norm_rtol:.3g}"
        return False, details
    return True, details


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
    check that it agrees with itself). `held` keeps earlier outputs alive, so an output that
    shares their memory is a buffer the candidate reuses, not a fresh allocation. Exceptions
    propagate."""
    inputs = problem.make_inputs(shape, fresh_seed(), device)
    pristine = inputs.clone()
    ref_inputs = pristine.clone()  # the reference gets its own copy: it may not see the candidate's
    ref = problem.reference(*ref_inputs.args, **ref_inputs.kwargs)
    poison_allocator(device, 2 * _nbytes(ref) + (1 << 20))
    out = fn(*inputs.args, **inputs.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    base = {"shape": shape.name, "dtype": shape.dtype, "trial": trial}
    for got, want in zip(inputs.tensors(), pristine.tensors(), strict=True):
        if not torch.equal(got, want):
            return ShapeCheck(**base, ok=False, message="the candidate modified its inputs")
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
    tol, scale = problem.tolerance(shape.dtype), problem.tolerance_scale(pristine)
    ok, details = compare(out, ref, tol, scale)
    if ok and repeat:
        poison_allocator(device, 2 * _nbytes(ref) + (1 << 20))
        second = fn(*inputs.args, **inputs.kwargs)
        first_storages = {t.untyped_storage().data_ptr() for t in output_tensors(out) if t.numel() > 0}
        if any(
            t.numel() > 0 and t.untyped_storage().data_ptr() in first_storages for t in output_tensors(second)
        ):
            return ShapeCheck(**base, ok=False, message="the output shares memory with an earlier output")
        again, _ = compare(second, out, tol, scale)
        if not again:
            return ShapeCheck(
                **base,
                ok=False,
                message="two runs on the same inputs disagree",
                **{k: v for k, v in details.items() if k != "message"},
            )
    return ShapeCheck(**base, ok=ok, **details)


def _kernel_classes() -> list[type]:
    from triton.runtime.jit import KernelInterface

    found, todo = [], [KernelInterface]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@contextlib.contextmanager
def kernels_disabled() -> Iterator[None]:
    """Every Triton kernel launch (jit, interpreted, autotuned) returns without running."""
    patched = [(cls, cls.__dict__["run"]) for cls in _kernel_classes() if "run" in cls.__dict__]
    try:
        for cls, _ in patched:
            cls.run = lambda self, *args, **kwargs: None
        yield
    finally:
        for cls, run in patched:
            cls.run = run


def kernels_do_the_work(problem: Problem, fn: Callable, device: torch.device) -> ShapeCheck:
    """The no-op proof: on the first check shape with a non-zero output, disable every Triton
    launch and check that the output is then wrong. A candidate whose output stays correct
    computed the op some other way (a torch fallback, a cached result). One that raises instead
    gave no output without its kernels, which counts as a wrong one: its host code read what a
    disabled kernel never wrote (row offsets a grouping kernel computes, say). A CUDA error is
    not such an answer: it leaves the device unusable, so it stays an error. (A candidate that
    detects its disabled kernels can always give a wrong output here on purpose; the proof
    catches fallbacks that do not, and the screen the torch functions that compute the op.)"""
    shape = next(s for s in problem.check_shapes if _nonzero_output(s))
    inputs = problem.make_inputs(shape, fresh_seed(), device)
    ref_inputs = inputs.clone()
    ref = problem.reference(*ref_inputs.args, **ref_inputs.kwargs)
    poison_allocator(device, 2 * _nbytes(ref) + (1 << 20))
    proof = partial(ShapeCheck, shape=shape.name, dtype=shape.dtype, trial=-1)
    with kernels_disabled():
        try:
            out = fn(*inputs.args, **inputs.kwargs)
        except Exception as exc:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # raises if the device is in error: that propagates
            return proof(
                ok=True, message=f"no output with every Triton kernel disabled ({type(exc).__name__})"
            )
    still_ok, _ = compare(out, ref, problem.tolerance(shape.dtype), problem.tolerance_scale(ref_inputs))
    message = "output is still correct with every Triton kernel disabled" if still_ok else ""
    return proof(ok=not still_ok, message=message)


def _nonzero_output(shape: Shape) -> bool:
    lengths = shape.params.get("lengths")
    return lengths is None or sum(lengths) > 0
