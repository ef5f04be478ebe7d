"""Ray backend: evaluations scheduled as tasks on a Ray cluster, so a campaign spreads over many hosts.

Each evaluation is one Ray task that runs a local-backend evaluation on the host Ray picks, so
the same judge and runner protocol, and every rule of the local backend, hold there: a judge
process that alone writes the result, its runner in bubblewrap (own user, PID, mount and network
namespaces, read-only files but its scratch directory), the timing lock taken by the judge, and
the wall-clock timeout. The task only
carries the candidate in and the result out, both as JSON like the local worker's files.

A task holds one GPU where the cluster has GPUs (Ray sets CUDA_VISIBLE_DEVICES for it, which the
local backend passes on to its worker, and whose timing lock is that GPU's own), else one CPU,
where Triton runs interpreted.

A cluster may hold GPUs of several kinds, and which kind runs a task is Ray's choice: each task
carries the kinds on which the caller holds its baselines (the judge times them on any other)
and the kernels to measure beside it on a kind that has not measured them (sandbox.backend.
Alongside). Tasks of one batch decide apart, so several of a batch that land on a new kind may
each time the baselines and measure those kernels there: once per batch and kind at most.

Assumptions about the cluster:
- every node holds this checkout at the same path, in the same Python environment (true of a
  local cluster; on many hosts, a shared filesystem or one image). Tasks find the packages
  through PYTHONPATH in their runtime environment: Ray's `working_dir` would upload the
  repository for every job, which is slow and buys nothing when the checkout is already there.
- a dead task (its Ray worker crashed, its node was lost) is not retried: a candidate that
  brings down a host would otherwise bring down the next one. It comes back as a runtime error.

Ray is imported inside functions: importing `sandbox` stays light, and the evaluation worker
(`sandbox.judge` and its runner, started by the local backend on the task's host) never import it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from sandbox.backend import Alongside
from sandbox.candidate import Candidate
from sandbox.local import REPO_ROOT, LocalBackend
from sandbox.result import LOG_TAIL_CHARS, EvalResult, Status
from sandbox.screen import screen_candidate

if TYPE_CHECKING:
    import ray


def _evaluate_on_host(
    candidate_json: str,
    backend_kwargs: dict[str, Any],
    eval_kwargs: dict[str, Any],
    alongside_json: str | None,
) -> str:
    """The Ray task: one local-backend evaluation on this host, its result as JSON."""
    candidate = Candidate.model_validate_json(candidate_json)
    alongside = None if alongside_json is None else Alongside.model_validate_json(alongside_json)
    result = LocalBackend(**backend_kwargs).evaluate(candidate, alongside=alongside, **eval_kwargs)
    return result.model_dump_json()


class RayBackend:
    """Evaluates candidates as Ray tasks, each a local-backend evaluation on its host."""

    name = "ray"
    # Tasks of a call run on several hosts, which share no directory to claim the baselines in.
    baselines_once = False

    def __init__(
        self,
        *,
        address: str | None = None,
        timeout_s: float = 300.0,
        scratch_root: str | os.PathLike | None = None,
        keep_scratch: bool = False,
        use_gpus: bool | None = None,
        artifact_root: str | os.PathLike | None = None,
        isolation: str = "bwrap",
    ) -> None:
        """`address` is `ray.init`'s: None finds RAY_ADDRESS or the cluster last started on this
        machine, else starts a local one; "ray://host:10001" (Ray Client, for a driver outside
        the cluster) needs the `ray[client]` extra. `scratch_root` and `artifact_root` are paths
        on each task's host (default: its temporary directory; no artifact reuse). `use_gpus`:
        one GPU per task; None decides by whether the cluster has GPUs now (pass True for a
        cluster whose GPU nodes are still joining)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        import ray

        if not ray.is_initialized():
            ray.init(
                address=address,
                ignore_reinit_error=True,
                include_dashboard=False,
                logging_level=logging.WARNING,
                # Workers write their output to their own log files; nothing is worth echoing here.
                log_to_driver=False,
            )
        if use_gpus is None:
            use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.timeout_s = timeout_s
        self.use_gpus = use_gpus
        # Plain values: they travel to the task's host, where a path means that host's path
        # (absolute here: a Ray worker's working directory is not the driver's).
        self._backend_kwargs = {
            "timeout_s": timeout_s,
            "scratch_root": None if scratch_root is None else os.path.abspath(scratch_root),
            "keep_scratch": keep_scratch,
            "artifact_root": None if artifact_root is None else os.path.abspath(artifact_root),
            "isolation": isolation,
        }
        self._task = ray.remote(_evaluate_on_host)
        self._task_options = {
            "num_gpus": 1 if use_gpus else 0,
            "num_cpus": 1,
            "max_retries": 0,
            # `${PYTHONPATH}` keeps the host's own entries (wheels on GPU hosts), after the checkout.
            "runtime_env": {"env_vars": {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}${{PYTHONPATH}}"}},
        }

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
        (result,) = self.evaluate_many(
            [candidate],
            check=check,
            timing=timing,
            baselines=baselines,
            baselines_held_on=baselines_held_on,
            trials=trials,
            alongside=alongside,
        )
        return result

    def evaluate_many(
        self,
        candidates: Sequence[Candidate],
        *,
        check: bool = True,
        timing: bool = True,
        baselines: list[str] | None = None,
        baselines_held_on: Collection[str] = (),
        trials: int = 2,
        alongside: Alongside | None = None,
        on_result: Callable[[int, EvalResult], None] | None = None,
    ) -> list[EvalResult]:
        """Submits every candidate at once, so the cluster runs as many as it has GPUs (or CPUs)
        for, then gathers the results in the order of `candidates` (each given to `on_result`
        as it is gathered)."""
        import ray

        eval_kwargs = {
            "check": check,
            "timing": timing,
            "baselines": baselines,
            "baselines_held_on": sorted(baselines_held_on),
            "trials": trials,
        }
        alongside_json = None if alongside is None else alongside.model_dump_json()
        # Screened here, as the local backend screens: a rejected candidate never costs a task.
        results = {i: r for i, c in enumerate(candidates) if (r := screen_candidate(c)) is not None}
        refs = {
            i: self._task.options(name=f"eval-{c.id}", **self._task_options).remote(
                c.model_dump_json(), self._backend_kwargs, eval_kwargs, alongside_json
            )
            for i, c in enumerate(candidates)
            if i not in results
        }
        try:
            if on_result is not None:
                for i in sorted(results):  # screened out
                    on_result(i, results[i])
            for i, ref in refs.items():
                results[i] = _gather(candidates[i], ref)
                if on_result is not None:
                    on_result(i, results[i])
        except BaseException:
            # An interrupt reaches each running task as KeyboardInterrupt, and the local
            # backend's clean-up there kills its worker's process group and scratch directory.
            for ref in refs.values():
                ray.cancel(ref)
            raise
        return [results[i] for i in range(len(candidates))]


def _gather(candidate: Candidate, ref: ray.ObjectRef) -> EvalResult:
    """The task's result, or a runtime error saying how the task itself failed."""
    import ray

    try:
        return EvalResult.model_validate_json(ray.get(ref))
    except ray.exceptions.RayError as exc:
        # Worker crashed, node lost, unschedulable, runtime environment not set up, or the task
        # function raised (e.g. the checkout is missing on that host): none is the candidate's
        # verdict, but the campaign goes on, as with a local worker that dies without a result.
        text = str(exc)
        first_line = next((line for line in text.splitlines() if line.strip()), "")
        return EvalResult(
            status=Status.RUNTIME_ERROR,
            problem=candidate.problem,
            candidate_id=candidate.id,
            message=f"ray task died without a result ({type(exc).__name__}: {first_line})"[:2000],
            log_tail=text[-LOG_TAIL_CHARS:],
        )
