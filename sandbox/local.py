"""Local backend: one worker process per evaluation, isolated and killable.

Each worker gets its own process group (so a fork cannot outlive a kill), its own scratch
directory (with its Triton cache inside), a scrubbed environment, a CPU-time limit, a hard
wall-clock timeout that kills the whole group, and no network where the OS allows a network
namespace (`unshare --net`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandbox.artifacts import ArtifactCache
from sandbox.candidate import Candidate
from sandbox.hardware import cuda_present
from sandbox.protocol import EvalRequest
from sandbox.result import EvalResult, Status
from sandbox.screen import screen_candidate

REPO_ROOT = Path(__file__).resolve().parents[1]
# Variables a worker may inherit; everything else (tokens, keys, proxies) stays behind.
PASSED_ENV = (
    "PATH",
    "LANG",
    "LC_ALL",
    "CUDA_VISIBLE_DEVICES",
    "LD_LIBRARY_PATH",
    "TRITON_INTERPRET",
    "CUDA_HOME",
    "TRITON_PTXAS_PATH",
)


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """`unshare` arguments that give the worker an empty network namespace, if permitted here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for args in ((unshare, "--net"), (unshare, "--map-root-user", "--net")):
        try:
            ok = subprocess.run([*args, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return args
    return ()


# Address-space cap of a worker without a GPU. (With CUDA none is set: the driver reserves
# address space far beyond what the process uses; the GPU's own memory bounds a GPU worker.)
CPU_ADDRESS_SPACE = 16 * 1024**3


# A worker whose evaluation ended with one of these compiled its kernels: its cache is worth keeping.
COMPILED = (Status.OK, Status.WRONG, Status.SUSPICIOUS)


class WorkerBackend:
    """What every backend that runs `sandbox.worker` on one host shares: screen first, then a
    fresh scratch directory per evaluation (seeded with the compiled artifacts of an earlier
    evaluation of the same source, where an artifact cache is set), removed afterwards.
    Subclasses run the worker, with its Triton cache at `scratch / "triton"`."""

    scratch_root: Path | None
    keep_scratch: bool
    artifacts: ArtifactCache | None = None

    def evaluate_many(self, candidates: Sequence[Candidate], **kwargs) -> list[EvalResult]:
        """One after another: the evaluations on one host share its GPU, and timings must not."""
        return [self.evaluate(c, **kwargs) for c in candidates]

    def evaluate(
        self,
        candidate: Candidate,
        *,
        check: bool = True,
        timing: bool = True,
        baselines: list[str] | None = None,
        trials: int = 2,
    ) -> EvalResult:
        rejected = screen_candidate(candidate)
        if rejected is not None:
            return rejected
        if self.scratch_root:
            self.scratch_root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"eval-{candidate.id}-", dir=self.scratch_root)).resolve()
        reused = self.artifacts is not None and self.artifacts.restore(candidate.id, scratch / "triton")
        try:
            result = self._run(
                candidate,
                scratch,
                EvalRequest(
                    problem=candidate.problem,
                    candidate_id=candidate.id,
                    source_file=self._source_file(scratch),
                    entry=candidate.entry,
                    check=check,
                    timing=timing,
                    baselines=baselines or [],
                    trials=trials,
                ),
            )
            if self.artifacts is not None and not reused and result.status in COMPILED:
                self.artifacts.save(candidate.id, scratch / "triton")
            return result.model_copy(update={"artifacts_reused": reused})
        finally:
            if not self.keep_scratch:
                shutil.rmtree(scratch, ignore_errors=True)

    def _source_file(self, scratch: Path) -> str:
        """Where the worker finds the candidate's source."""
        return str(scratch / "candidate.py")

    def _run(self, candidate: Candidate, scratch: Path, request: EvalRequest) -> EvalResult:
        raise NotImplementedError


class LocalBackend(WorkerBackend):
    """Evaluates candidates in worker processes on this machine."""

    name = "local"

    def __init__(
        self,
        *,
        timeout_s: float = 300.0,
        scratch_root: str | os.PathLike | None = None,
        keep_scratch: bool = False,
        parallel: int = 1,
        artifact_root: str | os.PathLike | None = None,
    ) -> None:
        """`parallel` workers run at once in `evaluate_many`: they import, compile and check side
        by side, and take turns for timing (a file lock), so timings stay those of a lone run.
        `artifact_root`: where compiled kernels are kept by content hash (None: never reused)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        self.timeout_s = timeout_s
        # Absolute: the worker runs with its scratch directory as working directory.
        self.scratch_root = Path(scratch_root).resolve() if scratch_root else None
        self.keep_scratch = keep_scratch
        self.parallel = parallel
        self.artifacts = ArtifactCache(artifact_root) if artifact_root else None
        # One lock per set of visible GPUs, shared by every backend on this host: two campaigns
        # on one GPU take turns too.
        devices = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "-") or "none"
        self.timing_lock = Path(tempfile.gettempdir()) / f"recforge-timing-{devices}.lock"

    def evaluate_many(self, candidates: Sequence[Candidate], **kwargs) -> list[EvalResult]:
        if self.parallel == 1 or len(candidates) < 2:
            return super().evaluate_many(candidates, **kwargs)
        with ThreadPoolExecutor(max_workers=self.parallel) as pool:
            return list(pool.map(lambda c: self.evaluate(c, **kwargs), candidates))

    def _env(self, scratch: Path) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        # The worker must import this checkout's packages (and, on GPU hosts, wheels on PYTHONPATH).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env.update(
            HOME=str(scratch),
            TMPDIR=str(scratch),
            TRITON_CACHE_DIR=str(scratch / "triton"),
            TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
            PYTHONDONTWRITEBYTECODE="1",
            PYTHONUNBUFFERED="1",
        )
        if not cuda_present():
            env["TRITON_INTERPRET"] = "1"
        return env

    def _run(self, candidate: Candidate, scratch: Path, request: EvalRequest) -> EvalResult:
        # CPU time backs up the wall-clock timeout (a worker that forks past the process group
        # kill still cannot spin forever); the address-space cap only where there is no GPU.
        request = request.model_copy(
            update={
                "timing_lock": str(self.timing_lock),
                "cpu_seconds": int(self.timeout_s) + 30,
                "address_space_bytes": None if cuda_present() else CPU_ADDRESS_SPACE,
            }
        )
        (scratch / "candidate.py").write_text(candidate.source)
        (scratch / "request.json").write_text(request.model_dump_json())
        result_path = scratch / "result.json"
        cmd = [
            *network_namespace_prefix(),
            sys.executable,
            "-m",
            "sandbox.worker",
            str(scratch / "request.json"),
            str(result_path),
        ]
        t0 = time.perf_counter()
        with open(scratch / "worker.log", "wb") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=scratch,
                env=self._env(scratch),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # Kill the whole group: forked children die with the worker, finished or not.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.perf_counter() - t0
        log_tail = (scratch / "worker.log").read_text(errors="replace")[-4000:]
        base = {
            "problem": candidate.problem,
            "candidate_id": candidate.id,
            "wall_s": wall,
            "log_tail": log_tail,
        }
        if timed_out:
            return EvalResult(status=Status.TIMEOUT, message=f"killed after {self.timeout_s:.0f} s", **base)
        if not result_path.exists():
            code = proc.returncode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return EvalResult(
                status=Status.RUNTIME_ERROR, message=f"worker died without a result ({how})", **base
            )
        result = EvalResult.model_validate_json(result_path.read_text())
        return result.model_copy(update={"wall_s": wall})
