"""Docker backend: the judge on this host, its runner in a locked-down container.

The judge (`python -m sandbox.judge`, as in LocalBackend) starts the runner in a container of
the local Docker daemon instead of bubblewrap, and speaks the same protocol to it over a Unix
socket in the runner's scratch directory (descriptors of shared regions pass through it as they
do through bubblewrap). The container's rules are written beside the settings that enforce them
in `container_settings`: no network, a read-only root with the interpreter, venv and the
`sandbox` package mounted read-only (nothing else of the repository), the runner's scratch
directory as the only writable host path, memory, CPU, process and file-size limits, no
capabilities, an unprivileged user. The judge removes the container when it ends, whatever
happened; this backend gives the judge a hard limit, as LocalBackend does.

`docker` is imported only when a backend or a container runner is built.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from sandbox.docker_image import REPO_ROOT, docker_client, ensure_image, mounted_roots
from sandbox.hardware import cuda_present
from sandbox.local import LocalBackend
from sandbox.protocol import EvalRequest
from sandbox.result import EvalResult

SCRATCH_DIR = "/scratch"
LABEL = "recforge.sandbox"
SOCKET_NAME = "judge.sock"


def container_settings(argv: list[str], runner_dir: Path, settings: dict) -> dict[str, Any]:
    """Keyword arguments of `containers.create` for the runner `argv`, with `runner_dir` (a host
    directory) mounted read-write at SCRATCH_DIR."""
    import docker

    gpus = settings["gpus"]
    env = {
        # The runner imports the `sandbox` package, mounted at its path.
        "PYTHONPATH": str(REPO_ROOT),
        "PATH": f"{Path(sys.prefix) / 'bin'}:/bin",
        "HOME": SCRATCH_DIR,
        "TMPDIR": SCRATCH_DIR,
        # In the scratch directory, so the backend can keep what it compiled.
        "TRITON_CACHE_DIR": f"{SCRATCH_DIR}/triton",
        "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_DIR}/inductor",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        # One thread per CPU granted: more only contend for the CPU quota.
        "OMP_NUM_THREADS": str(max(1, int(settings["cpus"]))),
    }
    device_requests = None
    if gpus:
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
    # Rule read-only code: the interpreter and venv, and of this repository only the `sandbox`
    # package, are visible at their host paths and cannot be changed.
    mounts = [
        docker.types.Mount(target=str(root), source=str(root.resolve()), type="bind", read_only=True)
        for root in mounted_roots()
    ]
    # Rule host writes: the runner's scratch directory is the only host path it can write.
    mounts.append(
        docker.types.Mount(target=SCRATCH_DIR, source=str(runner_dir), type="bind", read_only=False)
    )
    timeout = int(settings["timeout_s"]) + 30
    return {
        "image": settings["image"],
        "command": argv,
        # The label's value names the evaluation (its runner's directory on the host).
        "labels": {LABEL: str(runner_dir)},
        # Rule user: nobody, with no capability and no way to gain one.
        "user": "65534:65534",
        "working_dir": SCRATCH_DIR,
        "environment": env,
        # Rule network: no interfaces but loopback.
        "network_mode": "none",
        # Rule filesystem: a read-only root; /tmp in memory, counted against the memory limit.
        "read_only": True,
        "mounts": mounts,
        "tmpfs": {"/tmp": "rw,noexec,nosuid,nodev,size=64m,mode=1777"},
        # Rule resources: memory without swap, a CPU quota, a bound on processes and threads
        # (fork bombs), no core dumps, no file over 1 GiB (scratch is on the host's disk), and a
        # CPU-time limit that ends a spinning runner even if the judge dies first.
        "mem_limit": settings["mem_limit"],
        "memswap_limit": settings["mem_limit"],
        "nano_cpus": int(settings["cpus"] * 1e9),
        "pids_limit": 512,
        "ulimits": [
            docker.types.Ulimit(name="cpu", soft=timeout, hard=timeout),
            docker.types.Ulimit(name="core", soft=0, hard=0),
            docker.types.Ulimit(name="fsize", soft=1 << 30, hard=1 << 30),
        ],
        # Rule privileges: no capabilities, and no setuid binary can give any back.
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "device_requests": device_requests,
        # The daemon keeps the last MiB of output, enough for a log tail.
        "log_config": docker.types.LogConfig(type="json-file", config={"max-size": "1m", "max-file": "1"}),
    }


class ContainerRunner:
    """The judge's runner in a container: started, connected through a Unix socket in its
    scratch directory, and removed at the end (sandbox.judge.RunnerProcess uses it)."""

    def __init__(self, request: EvalRequest, limits: list[str], *, gpu: bool, deadline: float) -> None:
        import docker

        settings = dict(request.docker or {})
        runner_dir = Path(request.runner_dir)
        os.chmod(runner_dir, 0o777)  # the container's nobody writes its cache there
        path = runner_dir / SOCKET_NAME
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Bound through the directory's descriptor: a socket's path may hold at most 107 bytes,
        # and a scratch directory's can be longer.
        directory = os.open(runner_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self.listener.bind(f"/proc/self/fd/{directory}/{SOCKET_NAME}")
        finally:
            os.close(directory)
        os.chmod(path, 0o777)
        self.listener.listen(1)
        self.client = docker_client()
        connect = f"{SCRATCH_DIR}/{SOCKET_NAME}"
        argv = [sys.executable, "-P", "-m", "sandbox.runner", "--connect", connect, *limits]
        self.container = self.client.containers.create(**container_settings(argv, runner_dir, settings))
        self.mem_limit = settings["mem_limit"]
        self._docker_errors = docker.errors
        self.container.start()
        self.listener.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            self.sock, _ = self.listener.accept()
        except TimeoutError:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # closed: reads say so
        finally:
            self.listener.close()

    def how_it_ended(self) -> str:
        try:
            self.container.wait(timeout=5)
            self.container.reload()
        except Exception:  # noqa: BLE001 - the SDK's timeouts come in several types
            return "closed its channel"
        state = self.container.attrs["State"]
        if state.get("OOMKilled"):
            return f"died: out of memory (the container's {self.mem_limit} limit)"
        code = state.get("ExitCode")
        if code == 0:
            return "exited without answering"
        # Docker reports a process killed by signal N as exit code 128 + N.
        if isinstance(code, int) and code > 128:
            import signal

            with contextlib.suppress(ValueError):
                return f"died (signal {signal.Signals(code - 128).name})"
        return f"died (exit code {code})"

    def log_tail(self) -> str:
        try:
            return self.container.logs(stdout=True, stderr=True, tail=200).decode(errors="replace")
        except self._docker_errors.APIError:
            return ""

    def remove(self) -> None:
        with contextlib.suppress(self._docker_errors.NotFound, self._docker_errors.APIError):
            self.container.remove(force=True)


class DockerBackend(LocalBackend):
    """Evaluates candidates with the judge here and each runner in a container."""

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
        artifact_root: str | os.PathLike | None = None,
    ) -> None:
        """`gpus=None` passes the host's GPUs through when torch sees one. `image` replaces the
        image built from host files (`sandbox.docker_image`); a GPU host needs one with a C
        compiler, which Triton calls to build its launchers."""
        if cpus <= 0:
            raise ValueError(f"cpus must be positive, got {cpus}")
        super().__init__(
            timeout_s=timeout_s,
            scratch_root=scratch_root,
            keep_scratch=keep_scratch,
            artifact_root=artifact_root,
            isolation="none",  # replaced by the container in every request
        )
        self.isolation = "docker"
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
        self._image = image
        self.client = docker_client()  # fails here, in one sentence, when there is no daemon

    @functools.cached_property
    def image(self) -> str:
        return self._image or ensure_image(self.client)

    def _source_file(self, runner_dir: Path) -> str:
        return f"{SCRATCH_DIR}/candidate.py"

    def _end_runner(self, judge_pid: int, judge_dir: Path) -> None:
        """The runner's container removed (killed first; the call returns once it is gone), found
        by its label: the judge removes it when it ends, but not when it is killed."""
        import docker

        runner_dir = judge_dir.parent / "runner"  # LocalBackend._run's layout of the scratch directory
        try:  # a daemon that does not answer cannot remove it: the rest goes all the same
            found = self.client.containers.list(all=True, filters={"label": f"{LABEL}={runner_dir}"})
        except (docker.errors.DockerException, OSError):  # the HTTP client's errors are OSErrors
            found = []
        for container in found:
            with contextlib.suppress(docker.errors.DockerException, OSError):
                container.remove(force=True)
        super()._end_runner(judge_pid, judge_dir)

    def _run(self, candidate, scratch: Path, request: EvalRequest) -> EvalResult:
        request = request.model_copy(
            update={
                "docker": {
                    "image": self.image,
                    "mem_limit": self.mem_limit,
                    "cpus": self.cpus,
                    "gpus": self.gpus,
                    "timeout_s": self.timeout_s,
                }
            }
        )
        return super()._run(candidate, scratch, request)
