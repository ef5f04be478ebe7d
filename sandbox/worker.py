"""The evaluation worker: `python -m sandbox.worker REQUEST.json RESULT.json`.

Runs in its own process (started by a backend, which owns the timeout, the process group and
the scratch directory). Imports only torch, triton, pydantic, search_space and sandbox: it runs
on GPU hosts that hold none of the agent's dependencies.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import io
import platform
import resource
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch
import triton

from sandbox.hardware import roofline_seconds
from sandbox.protocol import EvalRequest, check_shape, fresh_seed, kernels_do_the_work
from sandbox.result import DeviceInfo, EvalResult, ShapeCheck, ShapeTiming, Status
from sandbox.timing import benchmark
from search_space.problem import Problem, get_problem

LOG_TAIL_CHARS = 4000


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name, arch = torch.cuda.get_device_name(device), f"sm_{major}{minor}"
    else:
        name, arch = platform.processor() or "cpu", "interpreter"
    return DeviceInfo(
        name=name,
        arch=arch,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        interpreted=device.type != "cuda",
    )


def load_candidate(path: Path, entry: str):
    spec = importlib.util.spec_from_file_location("candidate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["candidate"] = module  # triton's source inspection looks modules up here
    spec.loader.exec_module(module)
    fn = getattr(module, entry, None)
    if not callable(fn):
        raise AttributeError(f"the module defines no callable {entry!r}")
    return fn


def _is_compile_error(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"CompilationError", "CompileTimeAssertionFailure", "OutOfResources"})


def baseline_providers(problem: Problem, names: list[str], device: torch.device) -> dict:
    """The named baselines of `problem` as callables (unknown names: ValueError)."""
    known = {"reference": problem.reference, **problem.baselines}
    out = {}
    for name in names:
        if name == "reference.compile":
            # On a CPU this costs a C++ build per shape and times nothing a GPU cares about.
            if device.type == "cuda":
                out[name] = problem.compile_reference(problem.reference)
        elif name in known:
            out[name] = known[name]
        else:
            raise ValueError(f"unknown baseline {name!r}; known: {sorted(known) + ['reference.compile']}")
    return out


def time_shapes(
    problem: Problem, fn, request: EvalRequest, device: torch.device, arch: str
) -> list[ShapeTiming]:
    shapes = problem.timing_shapes if device.type == "cuda" else problem.interpreted_timing_shapes
    baselines = baseline_providers(problem, request.baselines, device)
    timings = []
    for shape in shapes:
        arg_sets = []
        for _ in range(request.input_sets if device.type == "cuda" else 1):
            inputs = problem.make_inputs(shape, fresh_seed(), device)
            arg_sets.append((inputs.args, inputs.kwargs))
        cand = benchmark(fn, arg_sets, device=device)
        base = {name: benchmark(b, arg_sets, device=device) for name, b in baselines.items()}
        flops, nbytes = problem.flops(shape), problem.bytes(shape)
        bound = roofline_seconds(arch, flops, nbytes)
        timings.append(
            ShapeTiming(
                shape=shape.name,
                dtype=shape.dtype,
                bucket=problem.bucket(shape),
                candidate=cand,
                baselines=base,
                flops=flops,
                bytes=nbytes,
                achieved_gbps=nbytes / (cand.median_us * 1e-6) / 1e9,
                roofline_fraction=None if bound is None else bound / (cand.median_us * 1e-6),
            )
        )
        del arg_sets
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return timings


class PhaseClock:
    """Seconds spent in each named phase; starting one ends the one before."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._name: str | None = None
        self._since = 0.0

    def start(self, name: str) -> None:
        self.stop()
        self._name, self._since = name, time.perf_counter()

    def stop(self) -> dict[str, float]:
        if self._name is not None:
            self.phases[self._name] = self.phases.get(self._name, 0.0) + time.perf_counter() - self._since
            self._name = None
        return dict(self.phases)


def evaluate(request: EvalRequest, log: io.StringIO) -> EvalResult:
    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = device_info(device)
    problem = get_problem(request.problem)
    base = {"problem": request.problem, "candidate_id": request.candidate_id, "device": info}

    clock = PhaseClock()

    def done(status: Status, message: str = "", **kw) -> EvalResult:
        # Failure paths pass their traceback as log_tail; it replaces the captured output.
        kw.setdefault("log_tail", log.getvalue()[-LOG_TAIL_CHARS:])
        return EvalResult(
            status=status,
            message=message,
            wall_s=time.perf_counter() - t0,
            phase_s=clock.stop(),
            **base,
            **kw,
        )

    def crashed(status: Status, where: str, exc: Exception, **kw) -> EvalResult:
        """The candidate raised: its message and traceback replace the captured output."""
        message = f"{where}: {type(exc).__name__}: {exc}"[:2000]
        return done(status, message, log_tail=traceback.format_exc()[-LOG_TAIL_CHARS:], **kw)

    try:
        clock.start("load")
        fn = load_candidate(Path(request.source_file), request.entry)
    except Exception as exc:  # the candidate's own code: anything can come out of it
        return crashed(Status.COMPILE_ERROR, "import failed", exc)

    checks: list[ShapeCheck] = []
    held: list[torch.Tensor] = []  # every output stays alive, so none can be handed out twice
    clock.start("check")
    if request.check:
        for shape in problem.check_shapes:
            # At least two trials: a result cached per shape is caught by the second's fresh inputs.
            for trial in range(max(2, request.trials)):
                try:
                    with gpu_use(request.timing_lock, exclusive=False):
                        result = check_shape(problem, fn, shape, trial, device, repeat=trial == 0, held=held)
                except Exception as exc:
                    status = Status.COMPILE_ERROR if _is_compile_error(exc) else Status.RUNTIME_ERROR
                    return crashed(status, shape.describe(), exc, checks=checks)
                checks.append(result)
                if not result.ok:
                    return done(Status.WRONG, f"{shape.describe()}: {result.message}", checks=checks)
        try:
            with gpu_use(request.timing_lock, exclusive=False):
                proof = kernels_do_the_work(problem, fn, device)
        except Exception as exc:
            return crashed(Status.RUNTIME_ERROR, "no-op proof", exc, checks=checks)
        checks.append(proof)
        if not proof.ok:
            return done(
                Status.SUSPICIOUS, f"{proof.message}: the op was not computed by its kernels", checks=checks
            )
    timings: list[ShapeTiming] = []
    window = None
    if request.timing:
        try:
            clock.start("lock_wait")
            with gpu_use(request.timing_lock, exclusive=True):
                clock.start("timing")
                start = time.time()
                timings = time_shapes(problem, fn, request, device, info.arch)
                window = (start, time.time())
        except Exception as exc:
            return crashed(Status.RUNTIME_ERROR, "timing", exc, checks=checks)
    return done(Status.OK, checks=checks, timings=timings, timing_window=window)


@contextlib.contextmanager
def gpu_use(lock_path: str | None, *, exclusive: bool) -> Iterator[None]:
    """Use of the GPU behind `lock_path` (nothing when None): shared for checks, which run side by
    side in several workers, exclusive for timing, which runs with no check beside it (with
    checks running beside them, embedding-bag timings in a four-worker H200 campaign spread by up
    to 93%, and the noise margin then refused a 2.5x faster kernel). A timer
    waiting at the turnstile keeps new checks from starting, so checks cannot starve it. Both
    locks are flock(2) locks: the kernel releases them when the process dies."""
    if lock_path is None:
        yield
        return
    with open(f"{lock_path}.turnstile", "a") as turnstile, open(lock_path, "a") as gpu:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(gpu, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(gpu, fcntl.LOCK_UN)


def apply_limits(request: EvalRequest) -> None:
    """Set the worker's own resource limits before any candidate code exists in the process.
    (Here rather than between fork and exec in the parent, which is unsafe when the parent has
    threads, as a Ray worker always does.)"""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if request.cpu_seconds is not None:
        resource.setrlimit(resource.RLIMIT_CPU, (request.cpu_seconds, request.cpu_seconds))
    if request.address_space_bytes is not None:
        limit = request.address_space_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(argv: list[str]) -> int:
    request_path, result_path = Path(argv[0]), Path(argv[1])
    request = EvalRequest.model_validate_json(request_path.read_text())
    apply_limits(request)
    log = io.StringIO()
    with redirect_stdout(log), redirect_stderr(log):
        result = evaluate(request, log)
    # Written last and atomically: a result file exists only if the worker finished.
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(result.model_dump_json())
    tmp.replace(result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
