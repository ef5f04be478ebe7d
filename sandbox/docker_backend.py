"""Docker backend: one container per evaluation, with LocalBackend's statuses.

The worker runs as in LocalBackend (`python -m sandbox.worker REQUEST RESULT`), inside a
container whose rules are written beside the settings that enforce them in `container_settings`:
no network, a read-only root with the interpreter, venv and repository mounted read-only, a
per-evaluation host directory as the only writable host path, memory, CPU, process and file-size
limits, no capabilities, and a wall-clock timeout after which the container is killed. Every
container is removed, whatever happened.

`docker` is imported only when a backend is built: `import sandbox` and the worker stay light.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from sandbox.artifacts import ArtifactCache
from sandbox.candidate import Candidate
from sandbox.docker_image import REPO_ROOT, docker_client, ensure_image, mounted_roots
from sandbox.hardware import cuda_present
from sandbox.local import WorkerBackend
from sandbox.protocol import EvalRequest
from sandbox.result import EvalResult, Status

if TYPE_CHECKING:
    pass

# The per-evaluation host directory, as the container sees it.
IO_DIR = "/io"
SCRATCH_DIR = "/scratch"
LOG_TAIL_CHARS = 4000
LABEL = "recforge.sandbox"


@dataclass(frozen=True)
class SandboxRun:
    """How one container run ended."""

    exit_code: int | None  # None when it was killed at the timeout
    oom_killed: bool
    timed_out: bool
    log: str  # the container's stdout and stderr
    wall_s: float


class DockerBackend(WorkerBackend):
    """Evaluates candidates in containers of the local Docker daemon."""

    name = "docker"

    def __init__(
        self,
        *,
        timeout_s: float = 300.0,
        mem_limit: str = "8g",
        cpus: float = 1.0,
        gpus: bool | None = None,
        scratch_root: str | os.PathLike | None = None,
        keep_scratch: bool = False,
        image: str | None = None,
        scratch_size: str = "2g",
        artifact_root: str | os.PathLike | None = None,
    ) -> None:
        """`gpus=None` passes the host's GPUs through when torch sees one. `image` replaces the
        image built from host files (`sandbox.docker_image`); a GPU host needs one with a C
        compiler, which Triton calls to build its launchers."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if cpus <= 0:
            raise ValueError(f"cpus must be positive, got {cpus}")
        self.timeout_s = timeout_s
        self.mem_limit = mem_limit
        self.cpus = cpus
        self.gpus = cuda_present() if gpus is None else gpus
        if self.gpus and image is None:
            # Triton builds a C launcher per kernel signature (cc and Python.h), which the image
            # built from host files does not carry.
            raise ValueError(
                "evaluating on GPUs in Docker needs an image with a C compiler and Python headers "
                "for Triton's launchers: pass image= (sandbox.docker_image in a campaign config), "
                "or gpus=False"
            )
        # Absolute: it is bind-mounted, and the daemon resolves no relative paths.
        self.scratch_root = Path(scratch_root).resolve() if scratch_root else None
        self.keep_scratch = keep_scratch
        self.scratch_size = scratch_size
        self._image = image
        self.artifacts = ArtifactCache(artifact_root) if artifact_root else None
        self.client = docker_client()  # fails here, in one sentence, when there is no daemon

    @functools.cached_property
    def image(self) -> str:
        return self._image or ensure_image(self.client)

    def _source_file(self, scratch: Path) -> str:
        return f"{IO_DIR}/candidate.py"  # the per-evaluation directory, as mounted in the container

    def _run(self, candidate: Candidate, io_dir: Path, request: EvalRequest) -> EvalResult:
        (io_dir / "candidate.py").write_text(candidate.source)
        (io_dir / "request.json").write_text(request.model_dump_json())
        result_path = io_dir / "result.json"
        argv = [sys.executable, "-m", "sandbox.worker", f"{IO_DIR}/request.json", f"{IO_DIR}/result.json"]
        run = self.run_in_sandbox(argv, io_dir)
        (io_dir / "worker.log").write_text(run.log)
        base = {
            "problem": candidate.problem,
            "candidate_id": candidate.id,
            "wall_s": run.wall_s,
            "log_tail": run.log[-LOG_TAIL_CHARS:],
        }
        if run.timed_out:
            return EvalResult(status=Status.TIMEOUT, message=f"killed after {self.timeout_s:.0f} s", **base)
        if not result_path.exists():
            return EvalResult(
                status=Status.RUNTIME_ERROR,
                message=f"worker died without a result ({self._how(run)})",
                **base,
            )
        try:
            result = EvalResult.model_validate_json(result_path.read_text())
        except ValidationError as exc:  # written from inside the sandbox: not trusted to parse
            return EvalResult(status=Status.RUNTIME_ERROR, message=f"unreadable result: {exc}"[:2000], **base)
        return result.model_copy(update={"wall_s": run.wall_s})

    def _how(self, run: SandboxRun) -> str:
        if run.oom_killed:
            return f"out of memory: the container hit its {self.mem_limit} memory limit"
        code = run.exit_code
        # Docker reports a process killed by signal N as exit code 128 + N.
        if code is not None and code > 128:
            with contextlib.suppress(ValueError):
                return f"signal {signal.Signals(code - 128).name}"
        return f"exit code {code}"

    def container_settings(self, argv: list[str], io_dir: Path) -> dict[str, Any]:
        """Keyword arguments of `containers.create` for one sandboxed run of `argv`, with
        `io_dir` (a host directory) mounted read-write at IO_DIR."""
        import docker

        env = {
            # The worker imports this checkout's packages; the repository is mounted at its path.
            "PYTHONPATH": str(REPO_ROOT),
            "PATH": f"{Path(sys.prefix) / 'bin'}:/bin",
            "HOME": SCRATCH_DIR,
            "TMPDIR": SCRATCH_DIR,
            # In the per-evaluation directory, so the backend can keep what it compiled.
            "TRITON_CACHE_DIR": f"{IO_DIR}/triton",
            "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_DIR}/inductor",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            # One thread per CPU granted: more only contend for the CPU quota.
            "OMP_NUM_THREADS": str(max(1, int(self.cpus))),
        }
        device_requests = None
        if self.gpus:
            # The host's CUDA_VISIBLE_DEVICES picks which GPUs go in; inside, they are all visible.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
            device_requests = [
                docker.types.DeviceRequest(
                    count=None if ids is not None else -1, device_ids=ids, capabilities=[["gpu"]]
                )
            ]
            env["NVIDIA_DRIVER_CAPABILITIES"] = "compute,utility"
        else:
            env["TRITON_INTERPRET"] = "1"
        mounts = [
            # Rule read-only code: the interpreter, venv and repository are visible at their host
            # paths (the venv's pyvenv.cfg names the prefix) and cannot be changed.
            docker.types.Mount(target=str(root), source=str(root.resolve()), type="bind", read_only=True)
            for root in mounted_roots()
        ]
        # Rule host writes: the per-evaluation directory is the only host path it can write.
        mounts.append(docker.types.Mount(target=IO_DIR, source=str(io_dir), type="bind", read_only=False))
        return {
            "image": self.image,
            "command": argv,
            "labels": {LABEL: "1"},
            # The host user: it can read the mounted prefix and own what it writes to io_dir.
            "user": f"{os.getuid()}:{os.getgid()}",
            "working_dir": SCRATCH_DIR,
            "environment": env,
            # Rule network: no interfaces but loopback.
            "network_mode": "none",
            # Rule filesystem: a read-only root; scratch space in memory, counted against the
            # memory limit. Triton loads what it builds from its cache, hence exec on /scratch.
            "read_only": True,
            "mounts": mounts,
            "tmpfs": {
                SCRATCH_DIR: f"rw,exec,nosuid,nodev,size={self.scratch_size},mode=1777",
                "/tmp": "rw,noexec,nosuid,nodev,size=64m,mode=1777",
            },
            # Rule resources: memory without swap, a CPU quota, a bound on processes and threads
            # (fork bombs), no core dumps, no file over 1 GiB (io_dir is on the host's disk), and,
            # as in LocalBackend, a CPU-time limit that ends a spinning worker even if this
            # process dies before it can kill the container.
            "mem_limit": self.mem_limit,
            "memswap_limit": self.mem_limit,
            "nano_cpus": int(self.cpus * 1e9),
            "pids_limit": 512,
            "ulimits": [
                docker.types.Ulimit(name="cpu", soft=int(self.timeout_s) + 30, hard=int(self.timeout_s) + 30),
                docker.types.Ulimit(name="core", soft=0, hard=0),
                docker.types.Ulimit(name="fsize", soft=1 << 30, hard=1 << 30),
            ],
            # Rule privileges: no capabilities, and no setuid binary can give any back.
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "device_requests": device_requests,
            # The daemon keeps the last MiB of output, enough for a log tail.
            "log_config": docker.types.LogConfig(
                type="json-file", config={"max-size": "1m", "max-file": "1"}
            ),
        }

    def run_in_sandbox(self, argv: list[str], io_dir: Path) -> SandboxRun:
        """Run `argv` in a sandbox container (the worker's, or a probe's), killing it at the
        timeout; the container is removed before this returns."""
        import docker
        import requests

        container = self.client.containers.create(**self.container_settings(argv, io_dir))
        try:
            t0 = time.perf_counter()
            container.start()
            timed_out = False
            try:
                container.wait(timeout=self.timeout_s)
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                # The SDK's wait gives up with a read timeout (wrapped in ConnectionError on a
                # unix socket) when the container is still running.
                timed_out = True
                with contextlib.suppress(docker.errors.APIError):
                    container.kill()
                container.wait(timeout=60)
            wall = time.perf_counter() - t0
            container.reload()
            state = container.attrs["State"]
            log = container.logs(stdout=True, stderr=True).decode(errors="replace")
            return SandboxRun(
                exit_code=None if timed_out else state["ExitCode"],
                oom_killed=bool(state.get("OOMKilled")),
                timed_out=timed_out,
                log=log,
                wall_s=wall,
            )
        finally:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
