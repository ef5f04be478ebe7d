"""Local backend: a judge process per evaluation on this host, with its runner in a sandbox.

Each evaluation gets a directory with two parts: the judge's (its request and result, which the
runner never sees) and the runner's scratch directory (the candidate's source and its Triton
cache; the only place the runner can write). The judge (`python -m sandbox.judge`) starts the
runner in bubblewrap (sandbox.isolation), checks and times it, and writes the result; this
backend gives the judge a hard wall-clock limit past the evaluation's own and kills its process
group at the end, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import ValidationError

from sandbox import cgroups, isolation, judge_server
from sandbox.artifacts import ArtifactCache
from sandbox.backend import Alongside, AlongsideClaims
from sandbox.candidate import Candidate
from sandbox.gpus import (
    GpusUnknown,
    Place,
    Places,
    gpu_place,
    gpu_uuids,
    host_place,
    split_cpus,
    visible_gpus,
)
from sandbox.hardware import cuda_present
from sandbox.isolation import SCRATCH, IsolationUnavailable, bwrap_works
from sandbox.locks import BaselineClaims, gpu_use
from sandbox.protocol import DEADLINE_MARK, EvalRequest
from sandbox.result import LOG_TAIL_CHARS, EvalResult, Status
from sandbox.screen import screen_candidate

REPO_ROOT = Path(__file__).resolve().parents[1]
# Variables the judge inherits; everything else (tokens, keys, proxies) stays behind.
PASSED_ENV = (
    "PATH",
    "RECFORGE_OPS",  # plug-in ops' modules (search_space.problem): the judge loads their problems
    "LANG",
    "LC_ALL",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",  # how CUDA_VISIBLE_DEVICES' indices are read: the backend's, which named the places
    "LD_LIBRARY_PATH",
    "TRITON_INTERPRET",
    "CUDA_HOME",
    "TRITON_PTXAS_PATH",
    "RECFORGE_TIMING_LOCK",  # how timed batches take the GPU's lock (sandbox.judge.TIMING_LOCK)
)


# Address-space cap of a worker without a GPU. (With CUDA none is set: the driver reserves
# address space far beyond what the process uses; EvalRequest.gpu_memory_bytes bounds a GPU
# worker's device memory.)
CPU_ADDRESS_SPACE = 16 * 1024**3


# Seconds the judge gets past the evaluation's own limit to end its runner and write a result.
JUDGE_GRACE_S = 60.0
# How often the wait for a judge looks whether it moved its deadline (protocol.DEADLINE_MARK).
MARK_POLL_S = 1.0

# A worker whose evaluation ended with one of these compiled its kernels: its cache is worth keeping.
COMPILED = (Status.OK, Status.WRONG, Status.SUSPICIOUS)


def judge_out_of_memory(result: EvalResult) -> bool:
    """Whether the judge itself (trusted code, whose failures alone read "the judge failed")
    ran out of device memory: torch's allocator, or the driver's for a shared region
    (CUDA_ERROR_OUT_OF_MEMORY is the driver's error 2)."""
    message = result.message
    return (
        result.status == Status.RUNTIME_ERROR
        and message.startswith("the judge failed: ")
        and ("OutOfMemoryError" in message or re.search(r"CUDA driver error 2\b", message) is not None)
    )


def _wait_within(wait: Callable[..., object], limit: float, judge_dir: Path) -> None:
    """`wait(timeout=...)` for a judge until it ends, or raise TimeoutError once its hard limit
    has passed: `limit` seconds from now, or later where the judge moved its deadline back while
    it waited for the GPU's lock (protocol.DEADLINE_MARK; the judge is trusted, and its runner
    cannot reach the judge's directory)."""
    end = time.monotonic() + limit
    mark = judge_dir / DEADLINE_MARK
    while True:
        with contextlib.suppress(OSError, ValueError):
            end = max(end, time.monotonic() + float(mark.read_text()) - time.time() + JUDGE_GRACE_S)
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the judge is still running after its limit of {limit:.0f} s")
        try:
            wait(timeout=min(MARK_POLL_S, left))
            return
        except (TimeoutError, subprocess.TimeoutExpired):
            continue


class WorkerBackend:
    """What every backend that runs `sandbox.judge` on one host shares: screen first, then a
    place to run (sandbox.gpus: a GPU of its own, or the host's GPUs as one), a fresh scratch
    directory per evaluation (seeded with the compiled artifacts of an earlier evaluation of the
    same source, where an artifact cache is set), removed afterwards. Subclasses run the worker,
    with its Triton cache at `scratch / "triton"`."""

    scratch_root: Path | None
    keep_scratch: bool
    artifacts: ArtifactCache | None = None
    parallel: int = 1  # evaluations at once per place
    _places: Places | None = None
    _gpu_nodes: dict[str, int | None] | None = None  # by GPU UUID (_gpu_node)

    @property
    def places(self) -> Places:
        """Where evaluations run, and how many at once on each (the host as one place, unlocked,
        unless a subclass sets others)."""
        if self._places is None:
            self._places = Places([Place(None)], self.parallel)
        return self._places

    # Within one evaluate_many call, the baselines are timed once per kind of device (BaselineClaims).
    baselines_once = True

    def evaluate_many(
        self,
        candidates: Sequence[Candidate],
        *,
        alongside: Alongside | None = None,
        on_result: Callable[[int, EvalResult], None] | None = None,
        **kwargs,
    ) -> list[EvalResult]:
        """As many at once as the places take, each on the place that frees first, in threads
        (each evaluation is a judge process); the results in the order of `candidates`, each
        also given to `on_result` with its index as it comes. The baselines asked for are timed
        by one evaluation per kind of device not held (BaselineClaims), so a call need not send
        its first candidate alone to have them timed."""
        claims = AlongsideClaims(alongside)
        with contextlib.ExitStack() as stack:
            if kwargs.get("baselines") and len(candidates) > 1:
                kwargs["baselines_claims"] = stack.enter_context(BaselineClaims()).path

            told = threading.Lock()

            def one(i: int) -> EvalResult:
                result = self._evaluate(candidates[i], claims, **kwargs)
                if on_result is not None:
                    with told:
                        on_result(i, result)
                return result

            workers = min(self.places.capacity, len(candidates))
            if workers <= 1:
                return [one(i) for i in range(len(candidates))]
            with ThreadPoolExecutor(max_workers=workers) as pool:
                return list(pool.map(one, range(len(candidates))))

    def evaluate(
        self,
        candidate: Candidate,
        *,
        check: bool = True,
        timing: bool = True,
        baselines: list[str] | None = None,
        baselines_held_on: Collection[str] = (),
        trials: int = 2,
        alongside: Alongside | None = None,
    ) -> EvalResult:
        return self._evaluate(
            candidate,
            AlongsideClaims(alongside),
            check=check,
            timing=timing,
            baselines=baselines,
            baselines_held_on=baselines_held_on,
            trials=trials,
        )

    def _evaluate(
        self,
        candidate: Candidate,
        claims: AlongsideClaims,
        *,
        check: bool = True,
        timing: bool = True,
        baselines: list[str] | None = None,
        baselines_held_on: Collection[str] = (),
        baselines_claims: Path | None = None,
        trials: int = 2,
    ) -> EvalResult:
        rejected = screen_candidate(candidate)
        if rejected is not None:
            return rejected
        with self.places.use() as place:
            result = self._evaluate_on(
                place,
                candidate,
                check=check,
                timing=timing,
                baselines=baselines or [],
                baselines_held_on=sorted(baselines_held_on),
                baselines_claims=None if baselines_claims is None else str(baselines_claims),
                trials=trials,
            )
            kernels = claims.claim(result)
            if kernels:
                # On the same GPU, while this evaluation's place is still held.
                asked = {"check": check, "timing": timing, "trials": trials}
                measured = [screen_candidate(k) or self._evaluate_on(place, k, **asked) for k in kernels]
                result = result.model_copy(update={"alongside": measured})
        return result

    def _evaluate_on(self, place: Place, candidate: Candidate, **asked) -> EvalResult:
        """One screened candidate's evaluation at `place`; `asked`: EvalRequest's fields."""
        if self.scratch_root:
            self.scratch_root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"eval-{candidate.id}-", dir=self.scratch_root)).resolve()
        runner_dir = scratch / "runner"
        runner_dir.mkdir()
        (runner_dir / "candidate.py").write_text(candidate.source)
        reused = self.artifacts is not None and self.artifacts.restore(candidate.id, runner_dir / "triton")
        try:
            request = EvalRequest(
                problem=candidate.problem,
                candidate_id=candidate.id,
                source_file=self._source_file(runner_dir),
                entry=candidate.entry,
                runner_dir=str(runner_dir),
                gpu=place.gpu,
                gpu_uuid=place.uuid,
                gpu_node=self._gpu_node(place),
                cpus=None if place.cpus is None else list(place.cpus),
                timing_locks=[str(lock) for lock in place.timing_locks],
                **asked,
            )
            result = self._run_sharing_memory(candidate, scratch, request, place.memory_locks)
            if self.artifacts is not None and not reused and result.status in COMPILED:
                self.artifacts.save(candidate.id, runner_dir / "triton")
            return result.model_copy(update={"artifacts_reused": reused})
        finally:
            if not self.keep_scratch:
                shutil.rmtree(scratch, ignore_errors=True)

    def _run_sharing_memory(
        self, candidate: Candidate, scratch: Path, request: EvalRequest, memory_locks: tuple[Path, ...]
    ) -> EvalResult:
        """_run beside the other evaluations on its GPU; again alone when the judge's own work ran
        out of device memory (theirs and its together: a gradient reference at a timing shape
        can hold tens of GiB), so an honest candidate is never failed for its neighbours."""
        with gpu_use(memory_locks, exclusive=False):
            result = self._run(candidate, scratch, request)
        if not memory_locks or not judge_out_of_memory(result):
            return result
        shutil.rmtree(scratch / "judge", ignore_errors=True)
        with gpu_use(memory_locks, exclusive=True):
            again = self._run(candidate, scratch, request)
        # Both runs' time counts (a budget's device seconds are phases). A judge that failed has
        # no phases of its own; the part of the first run they leave out is named for its cause
        # (agent.store.DEVICE_PHASES counts it). The first run's message heads the log tail, on
        # one line.
        phases = dict(result.phase_s)
        phases["beside_out_of_memory"] = result.unphased_s()
        for name, seconds in again.phase_s.items():
            phases[name] = phases.get(name, 0.0) + seconds
        first = " ".join(f"the first run, beside other evaluations: {result.message}".split())[:500]
        tail = f"{first}\n{again.log_tail[-(LOG_TAIL_CHARS - len(first) - 1) :]}"
        wall = again.wall_s + result.wall_s
        return again.model_copy(update={"wall_s": wall, "phase_s": phases, "log_tail": tail})

    def _gpu_node(self, place: Place) -> int | None:
        """The device node of the place's GPU, where a runner sandboxed with it alone sees that
        GPU: found and probed once per GPU for the backend's life, not by each evaluation's
        judge; None where unknown or not so."""
        if getattr(self, "isolation", None) != "bwrap" or place.uuid is None:
            return None
        if self._gpu_nodes is None:
            self._gpu_nodes = {}
        if place.uuid not in self._gpu_nodes:
            minor = isolation.gpu_minor(place.uuid)
            works = minor is not None and isolation.one_gpu_sandbox_works(minor)
            self._gpu_nodes[place.uuid] = minor if works else None
        return self._gpu_nodes[place.uuid]

    def _source_file(self, runner_dir: Path) -> str:
        """Where the runner finds the candidate's source."""
        return f"{SCRATCH}/candidate.py"

    def _run(self, candidate: Candidate, scratch: Path, request: EvalRequest) -> EvalResult:
        raise NotImplementedError


def _uuids_by_name() -> dict[str, str]:
    """The UUID of each GPU this process sees, by the name sandbox.gpus.visible_gpus gives it
    (empty on a host without a GPU; sandbox.gpus.GpusUnknown where the driver cannot say)."""
    if not cuda_present():
        return {}
    uuids, visible = gpu_uuids(), visible_gpus()
    if uuids is None or len(uuids) != len(visible):
        raise GpusUnknown(
            f"the CUDA driver named {'no' if uuids is None else len(uuids)} GPU(s) of the {len(visible)} "
            "torch counts: the locks that keep two campaigns' timings on one GPU apart are named by "
            "each GPU's UUID"
        )
    return dict(zip(visible, uuids, strict=True))


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
        isolation: str = "bwrap",
        gpus: Sequence[str] | None = None,
    ) -> None:
        """`gpus`: the GPUs to evaluate on, each a place of its own (sandbox.gpus.select_gpus
        chooses them; names as CUDA_VISIBLE_DEVICES gives them): each evaluation's judge sees
        one, and each GPU has its own timing and memory locks, so evaluations on different GPUs
        time at once. None: the GPUs this process sees, as one place. `parallel` evaluations run
        at once per place in `evaluate_many`: they import, compile and check side by side, and
        take turns for timing (a file lock), so timings stay those of a lone run.
        `artifact_root`: where compiled kernels are kept by content hash (None: never reused).
        `isolation`: "bwrap" (sandbox.isolation); "none" runs the runner as a plain process, for
        hosts without user namespaces, and holds nothing against a hostile one."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        if gpus is not None and (not gpus or len(set(gpus)) != len(gpus)):
            raise ValueError(f"gpus must name at least one GPU, each once; got {list(gpus)}")
        if isolation not in ("bwrap", "none"):
            raise ValueError(f"isolation must be 'bwrap' or 'none', got {isolation!r}")
        if isolation == "bwrap" and (why := bwrap_works(cuda_present())) is not None:
            raise IsolationUnavailable(
                f"the local backend's sandbox cannot run here: {why}. Install or fix bubblewrap "
                "(`make bwrap`, or RECFORGE_BWRAP naming its binary), or, on a host that runs only "
                'trusted code, set isolation = "none" under [sandbox] (it holds nothing against a '
                "hostile candidate)"
            )
        self.isolation = isolation
        self.timeout_s = timeout_s
        # Absolute: the judge and runner run with other working directories.
        self.scratch_root = Path(scratch_root).resolve() if scratch_root else None
        self.keep_scratch = keep_scratch
        self.parallel = parallel
        self.artifacts = ArtifactCache(artifact_root) if artifact_root else None
        # Locks shared by every backend on this host, one per GPU and named by its UUID: two
        # campaigns on one GPU take turns, however each names it, and one that holds the host's
        # GPUs as one place takes every one's. Without a GPU there are none: interpreted timings
        # decide nothing (agent.nodes), and holding every evaluation's checks still while one of
        # them times on the CPU would leave the host's cores idle in a convoy behind each timing.
        self.gpus = list(gpus) if gpus is not None else None
        if self.gpus is not None:
            cores = split_cpus(len(self.gpus))
            uuid = _uuids_by_name()
            self._places = Places(
                [gpu_place(g, cpus, uuid.get(g)) for g, cpus in zip(self.gpus, cores, strict=True)], parallel
            )
        else:
            self._places = Places([host_place() if cuda_present() else Place(None)], parallel)

    def warm_up(self) -> None:
        """Start the judges' fork server now (where judges are forked from one: sandbox.judge_server),
        so that the first evaluation does not wait for its imports."""
        if judge_server.enabled():
            judge_server.server_for(self._env())

    def _env(self) -> dict[str, str]:
        """The judge's environment (trusted code; the runner's own is sandbox.isolation's)."""
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        # The judge imports this checkout's packages (and, on GPU hosts, wheels on PYTHONPATH).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
        if "RECFORGE_BWRAP" in os.environ:
            env["RECFORGE_BWRAP"] = os.environ["RECFORGE_BWRAP"]
        return env

    def _end_runner(self, judge_pid: int, judge_dir: Path) -> None:
        """The runner of the judge `judge_pid` (working in `judge_dir`) killed, and waited for
        until gone: its control groups (sandbox.cgroups)."""
        cgroups.remove_groups_of(judge_pid)

    def _judge(self, cmd: list[str], judge_dir: Path) -> tuple[bool, int, float]:
        """Run the judge `cmd` (python -P -m sandbox.judge ...) in `judge_dir` until it ends or
        its hard limit passes, then kill its process group (the judge and, through bubblewrap,
        its runner's namespace): (timed out, exit code, seconds until it was started). Forked
        from the judge server where it runs (sandbox.judge_server; the judge then dies with the
        server, which ends with this process), else a process of its own.

        A judge killed drops its GPU locks at once (the kernel releases a dead process's flocks)
        while its runner, dying with it, may still have work on the GPU: so the runner is killed
        and waited for first (_end_runner), and no other evaluation times beside what it left
        running. (Without a control group, a bubblewrapped runner dies with the judge's process
        group.)"""
        limit = self.timeout_s + JUDGE_GRACE_S
        log = judge_dir / "judge.log"
        log.touch()  # read afterwards, whether or not the judge got as far as writing to it
        t0 = time.perf_counter()
        if judge_server.enabled():
            try:
                judge = judge_server.start_judge(self._env(), cmd[4:6], judge_dir, log)
            except judge_server.ServerUnavailable as exc:
                warnings.warn(f"{exc}; this judge starts on its own", stacklevel=2)
            else:
                spawn = time.perf_counter() - t0
                timed_out = False
                try:
                    _wait_within(judge.wait, limit, judge_dir)
                except TimeoutError:
                    timed_out = True
                finally:
                    try:
                        if judge.returncode is None:  # its runner first (see above)
                            self._end_runner(judge.pid, judge_dir)
                    finally:  # whatever that met, the judge goes
                        judge.kill()
                    if timed_out:
                        with contextlib.suppress(TimeoutError):
                            judge.wait(timeout=30)
                    cgroups.remove_groups_of(judge.pid)
                code = judge.returncode if judge.returncode is not None else -int(signal.SIGKILL)
                return timed_out, code, spawn
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd, cwd=judge_dir, env=self._env(), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            spawn, timed_out = time.perf_counter() - t0, False
            try:
                _wait_within(proc.wait, limit, judge_dir)
            except TimeoutError:
                timed_out = True
            finally:
                if proc.returncode is None:  # unreaped: its pid and group cannot name another process
                    try:
                        self._end_runner(proc.pid, judge_dir)  # its runner first (see above)
                    finally:  # whatever that met, the judge goes
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                cgroups.remove_groups_of(proc.pid)
        return timed_out, proc.returncode, spawn

    def _run(self, candidate: Candidate, scratch: Path, request: EvalRequest) -> EvalResult:
        # CPU time backs up the wall-clock timeout; the address-space cap only where there is no
        # GPU. The judge ends the evaluation at timeout_s; this process ends the judge after that.
        request = request.model_copy(
            update={
                "cpu_seconds": int(self.timeout_s) + 30,
                "address_space_bytes": None if cuda_present() else CPU_ADDRESS_SPACE,
                "timeout_s": self.timeout_s,
                "isolation": self.isolation,
                "source_file": (
                    request.source_file
                    if self.isolation != "none"
                    else str(Path(request.runner_dir) / "candidate.py")
                ),
            }
        )
        judge_dir = scratch / "judge"
        judge_dir.mkdir(mode=0o700)
        (judge_dir / "request.json").write_text(request.model_dump_json())
        result_path = judge_dir / "result.json"
        # -P: the judge's directory is not an import path (the runner's sandbox binds every
        # import path of the judge, and must never see this directory).
        # This process's pid: the judge dies with it (a killed campaign leaves nothing on the GPU).
        cmd = [sys.executable, "-P", "-m", "sandbox.judge", str(judge_dir / "request.json"), str(result_path),
               str(os.getpid())]  # fmt: skip
        t0 = time.perf_counter()
        timed_out, returncode, spawn = self._judge(cmd, judge_dir)
        wall, reaped = time.perf_counter() - t0, time.time()
        log_tail = (judge_dir / "judge.log").read_text(errors="replace")[-LOG_TAIL_CHARS:]
        base = {
            "problem": candidate.problem,
            "candidate_id": candidate.id,
            "wall_s": wall,
            "log_tail": log_tail,
        }
        if timed_out:
            return EvalResult(
                status=Status.TIMEOUT,
                message=f"killed after {wall:.0f} s (limit {self.timeout_s:.0f} s)",
                **base,
            )
        if not result_path.exists():
            code = returncode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return EvalResult(
                status=Status.RUNTIME_ERROR, message=f"the judge died without a result ({how})", **base
            )
        try:
            result = EvalResult.model_validate_json(result_path.read_text())
        except ValidationError as exc:  # the judge's own bug; never the campaign's crash
            return EvalResult(
                status=Status.RUNTIME_ERROR, message=f"unreadable judge result: {exc}"[:2000], **base
            )
        # The backend's share of the judge's life: its start (spawn: forked, or a process of its
        # own started) and its exit (from its result's writing to its reaping). Both are held to
        # what the wall time leaves beside the judge's own phases: a forked judge's clock starts
        # before the server's answer reaches this process (on a loaded host, half a second
        # after), and the file's mtime comes from the kernel's coarse clock (a tick of several ms
        # early at most).
        # The exit first: it is measured apart from the spawn, which only its overlap inflates.
        left = max(0.0, wall - sum(result.phase_s.values()))
        exit_s = None
        with contextlib.suppress(OSError):
            exit_s = max(0.0, min(reaped - result_path.stat().st_mtime, left))
        phases = {"spawn": min(spawn, left - (exit_s or 0.0)), **result.phase_s}
        if exit_s is not None:
            phases["exit"] = exit_s
        return result.model_copy(update={"wall_s": wall, "phase_s": phases})
