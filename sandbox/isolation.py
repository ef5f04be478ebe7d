"""Where the runner runs: a bubblewrap sandbox that holds as root.

Rules (each enforced where it is written below):
- user: the runner is an unprivileged user in a user namespace of its own. Under a judge running
  as root, bubblewrap sets up the mounts as root (the Python installation may sit where only root
  can traverse, as under /root) and the runner, before any candidate code exists, becomes
  `nobody` (uid 65534) and then enters a new user namespace that maps nobody to nobody, with every
  capability dropped (runner.become_unprivileged): outside it owns no file of the host and holds
  no capability, so it cannot setns() back into the host's namespaces. Under any other user,
  bubblewrap makes the user namespace itself, unprivileged, and refuses nested ones.
- namespaces: its own user, PID, mount, network, IPC and UTS namespaces (cgroup where allowed).
- network: the new network namespace has only its own loopback interface (bubblewrap brings it
  up): no route anywhere else, the host's loopback included.
- filesystem: an empty root with, read-only, the system directories, the Python installation and
  the import paths the runner needs (of this repository, only the `sandbox` package, so neither
  campaign state nor the judge's files are there), a private /tmp and /dev/shm, GPU device nodes
  where a GPU is used (where its evaluation has a GPU of its own, EvalRequest.gpu, that GPU's
  alone, if the host's driver lets a sandbox see one GPU so: then it cannot reach, and slow, a
  kernel timed on another GPU), and one writable directory: the runner's scratch directory at
  /scratch.
- processes: --die-with-parent and a new PID namespace, so when the judge kills bubblewrap (or
  dies) every process the runner started dies with it, whatever session or process group it
  made for itself; --new-session takes the terminal away.
- resources: under a root judge, where the host allows, a control group of its own
  (sandbox.cgroups) holding everything it starts to MEMORY_BYTES of the host's memory and
  TASK_BUDGET tasks; limits the runner sets on itself before any candidate code exists
  (sandbox.confine: CPU time, address space on a CPU, file size, and, without a group, the tasks
  its user may run, TASK_BUDGET more than it runs already); a private /tmp and /dev/shm of
  TMPFS_BYTES each; and the judge's watch on the scratch directory, which stops a runner that
  holds more there than its request's quota (EvalRequest.scratch_bytes and scratch_files;
  sandbox.judge.RunnerProcess).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sandbox.cgroups import RunnerCgroup
from sandbox.docker_image import RUNNER_CODE

REPO_ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
SCRATCH = "/scratch"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
# What the dynamic loader and a C compiler (Triton builds its launchers with one) read from /etc.
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives")
# Rule resources. A runner uses a few dozen threads (torch's pools, the CUDA driver's, a compiler
# or two); TMPDIR is the scratch directory, so /tmp and /dev/shm hold only what the candidate
# puts there, in the host's memory.
TASK_BUDGET = 1024
TMPFS_BYTES = 256 * 1024**2
# The host memory of everything a runner starts, where it has a group: a CUDA context, torch and
# Triton take one or two GiB, an interpreted kernel's NumPy arrays several times its inputs.
MEMORY_BYTES = 16 * 1024**3


class IsolationUnavailable(RuntimeError):
    """bubblewrap is missing, or this kernel refuses it the namespaces it needs."""


def bwrap_path() -> str | None:
    """`RECFORGE_BWRAP` if set, else `bwrap` on PATH."""
    return os.environ.get("RECFORGE_BWRAP") or shutil.which("bwrap")


def drops_privileges() -> bool:
    """Whether the runner must make itself unprivileged (rule user): a root judge's runner."""
    return os.geteuid() == 0


def _import_roots() -> list[Path]:
    """Directories the runner's Python reads: its installation, and every import path but this
    repository's root (of which RUNNER_CODE is bound on its own)."""
    roots = {Path(sys.base_prefix), Path(sys.prefix)}
    cwd = Path.cwd().resolve()
    for entry in sys.path:
        if not entry:
            continue  # the working directory: the judge's own (rule filesystem)
        path = Path(entry).resolve()
        if path == cwd or Path(tempfile.gettempdir()).resolve().is_relative_to(path):
            continue  # nor the host's temporary directory, where judges keep their files
        if path.is_dir() and path != REPO_ROOT and not path.is_relative_to(REPO_ROOT / "sandbox"):
            roots.add(path)
    for entry in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if entry and Path(entry).is_dir():
            roots.add(Path(entry).resolve())
    kept: list[Path] = []
    for root in sorted(roots):
        # Nested ones, and those a system directory brings in already, are not bound twice.
        if any(root.is_relative_to(k) for k in kept) or any(
            root.is_relative_to(s) for s in SYSTEM_DIRS if Path(s).is_dir() and not Path(s).is_symlink()
        ):
            continue
        kept.append(root)
    return kept


def gpu_devices(only: int | None = None, dev: Path = Path("/dev")) -> list[str]:
    """The GPU device nodes a runner gets: the driver's control nodes, and every GPU's
    (nvidiaN), or GPU `only`'s alone."""
    nodes = sorted(p for p in dev.glob("nvidia*") if not p.is_dir())
    if only is not None:
        nodes = [n for n in nodes if re.fullmatch(r"nvidia\d+", n.name) is None or n.name == f"nvidia{only}"]
    return [str(n) for n in nodes] + ([str(dev / "nvidia-caps")] if (dev / "nvidia-caps").is_dir() else [])


def uuid_key(uuid: str) -> str:
    """A GPU's UUID as its hex digits alone, however it is written (`GPU-8f2a0c1e-...`, torch's
    bare form, upper or lower case)."""
    return re.sub(r"[^0-9a-f]", "", uuid.lower().removeprefix("gpu-").removeprefix("mig-"))


def gpu_minor(uuid: str, gpus: Path = Path("/proc/driver/nvidia/gpus")) -> int | None:
    """The device minor number (its node is /dev/nvidiaN) of the GPU with `uuid`, as the
    driver's entries under `gpus` give it; None where they do not."""
    want = uuid_key(uuid)
    for info in sorted(gpus.glob("*/information")):
        with contextlib.suppress(OSError):
            fields = dict(line.split(":", 1) for line in info.read_text().splitlines() if ":" in line)
            if uuid_key(fields.get("GPU UUID", "")) == want:
                with contextlib.suppress(KeyError, ValueError):
                    return int(fields["Device Minor"].strip())
                return None
    return None


# Run in a runner's sandbox given one GPU's node: exit 0 where the CUDA driver sees exactly one.
_ONE_GPU_PROBE = (
    "import ctypes, sys; c = ctypes.CDLL('libcuda.so.1'); n = ctypes.c_int(); "
    "sys.exit(0 if c.cuInit(0) == 0 and c.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value == 1 else 1)"
)


@functools.cache
def one_gpu_sandbox_works(minor: int) -> bool:
    """Whether a runner whose sandbox holds GPU `minor`'s device node alone sees that one GPU
    here (the CUDA driver asked directly, in the runner's sandbox)."""
    try:
        with tempfile.TemporaryDirectory(prefix="recforge-gpu-probe-") as tmp:
            scratch = Path(tmp) / "scratch"
            prepare_scratch(scratch)
            done = subprocess.run(
                bwrap_command(scratch, [sys.executable, "-c", _ONE_GPU_PROBE], gpu=True, only_gpu=minor),
                # Without CUDA_VISIBLE_DEVICES: the count is of every GPU the sandbox reaches.
                env={k: v for k, v in runner_env(gpu=True).items() if k != "CUDA_VISIBLE_DEVICES"},
                capture_output=True,
                timeout=60,
            )
    except (IsolationUnavailable, OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def bwrap_command(scratch: Path, argv: list[str], *, gpu: bool, only_gpu: int | None = None) -> list[str]:
    """The bubblewrap command line that runs `argv` in the runner's sandbox; with a GPU, every
    GPU's device node, or (only_gpu) that GPU's alone (its minor number)."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise IsolationUnavailable(
            "bubblewrap (bwrap) is not installed: `make bwrap` (as root on Debian: apt-get install "
            "bubblewrap), or point RECFORGE_BWRAP at its binary"
        )
    cmd = [bwrap]
    # Rule namespaces (the user namespace: see rule user).
    cmd += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not drops_privileges():
        cmd += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    # Rule processes.
    cmd += ["--die-with-parent", "--new-session"]
    # Rule filesystem: system directories as they are (merged /usr keeps /bin a link).
    for d in SYSTEM_DIRS:
        p = Path(d)
        if p.is_symlink():
            cmd += ["--symlink", os.readlink(p), d]
        elif p.is_dir():
            cmd += ["--ro-bind", d, d]
    for f in ETC_FILES:
        cmd += ["--ro-bind-try", f, f]
    # Before the binds: an import root may lie under /tmp (wheels installed there on a GPU host).
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    for tmp in ("/tmp", "/dev/shm"):
        # Rule resources: sized where bubblewrap can (0.6 and later), else the kernel's default.
        cmd += (["--size", str(TMPFS_BYTES)] if _sizes_tmpfs(bwrap) else []) + ["--tmpfs", tmp]
    binds = [*_import_roots(), *RUNNER_CODE]
    # Parents that bubblewrap would create for a mount point come out mode 0700: the runner's
    # user could not walk through them (a Python under /root, say).
    parents = sorted({str(a) for b in binds for a in b.parents if str(a) != "/"} - set(SYSTEM_DIRS))
    for parent in parents:
        if not any(Path(parent).is_relative_to(s) for s in SYSTEM_DIRS):
            cmd += ["--perms", "0755", "--dir", parent]
    for root in binds:
        cmd += ["--ro-bind", str(root), str(root)]
    if gpu:
        for node in gpu_devices(only_gpu):
            cmd += ["--dev-bind", node, node]
        # The CUDA driver reads the device's PCI topology there.
        cmd += ["--ro-bind", "/sys", "/sys"]
    cmd += ["--bind", str(scratch), SCRATCH, "--chdir", SCRATCH]
    return [*cmd, "--", *argv]


@functools.cache
def _sizes_tmpfs(bwrap: str) -> bool:
    """Whether this bubblewrap takes `--size` for a tmpfs."""
    try:
        usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--size" in usage


def tasks_of(uid: int) -> int:
    """How many processes and threads of real user `uid` run on this host now (what the kernel
    counts against RLIMIT_NPROC)."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # it ended meanwhile
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def task_limit(*, own_user_namespace: bool) -> int:
    """Rule resources: RLIMIT_NPROC for the runner. Since Linux 5.14 the kernel counts a user's
    tasks per user namespace: in one of its own, the runner's budget is the bound. Otherwise the
    count is of every task of the real uid on the host, and the budget comes on top of those."""
    release = tuple(int(part) for part in os.uname().release.split("-")[0].split(".")[:2] if part.isdigit())
    if own_user_namespace and release >= (5, 14):
        return TASK_BUDGET
    return tasks_of(NOBODY if drops_privileges() else os.getuid()) + TASK_BUDGET


def lift_host_task_bound() -> None:
    """Rule resources, under a root judge: as high a limit on tasks as it may give what it
    starts. The runner's user namespace records the limit its maker held as the most tasks its
    user may run on the whole host, so a low inherited `ulimit -u` would make the runner's
    budget hang on every other process of `nobody` there (other runners, containers). Root's
    own tasks are never counted against the limit, so the judge loses nothing by it."""
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):  # without CAP_SYS_RESOURCE: up to the hard limit
        resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))


def runner_env(*, gpu: bool, one_gpu: bool = False) -> dict[str, str]:
    """The runner's whole environment: nothing of the judge's (tokens, keys, proxies) but what a
    GPU or the interpreter needs. `one_gpu`: its sandbox holds one GPU's device node, which the
    driver numbers 0 there."""
    env = {
        k: os.environ[k]
        for k in ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LD_LIBRARY_PATH",
                  "CUDA_HOME", "TRITON_PTXAS_PATH", "TRITON_LIBCUDA_PATH")
        if k in os.environ
    }  # fmt: skip
    paths = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
        HOME=SCRATCH,
        TMPDIR=SCRATCH,
        TRITON_CACHE_DIR=f"{SCRATCH}/triton",
        TORCHINDUCTOR_CACHE_DIR=f"{SCRATCH}/inductor",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
    )
    if one_gpu:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    if not gpu:
        env["TRITON_INTERPRET"] = "1"
    elif "TRITON_LIBCUDA_PATH" not in env and (libcuda := _libcuda_dir()) is not None:
        # Triton finds the driver with `ldconfig -p`, which fails inside the sandbox; told where
        # it is, it asks nothing.
        env["TRITON_LIBCUDA_PATH"] = libcuda
    return env


@functools.cache
def _libcuda_dir() -> str | None:
    """The directory of the CUDA driver library, as this host's loader cache lists it."""
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return os.environ["TRITON_LIBCUDA_PATH"]
    try:
        listing = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in listing.splitlines():
        if "libcuda.so.1" in line and "=>" in line:
            return str(Path(line.split("=>")[1].strip()).parent)
    return None


def prepare_scratch(scratch: Path) -> None:
    """The scratch directory belongs to the runner's user: only there can it write."""
    scratch.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        for dirpath, dirnames, filenames in os.walk(scratch):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.chown(name, NOBODY, NOBODY, follow_symlinks=False)


def start_runner(
    argv: list[str],
    scratch: Path,
    *,
    gpu: bool,
    pass_fds: tuple[int, ...],
    stdout,
    isolation: str = "bwrap",
    cgroup: RunnerCgroup | None = None,
    only_gpu: int | None = None,
) -> subprocess.Popen:
    """Start `argv` (the runner) in its sandbox, inside `cgroup` where it has one (which then
    bounds its tasks instead of RLIMIT_NPROC); `only_gpu`: the minor number of the one GPU whose
    device node its sandbox holds (None: every GPU's). `isolation="none"` runs it as a plain
    child process instead, for hosts without user namespaces; never the default (rule: none
    holds)."""
    env = runner_env(gpu=gpu, one_gpu=only_gpu is not None and isolation == "bwrap")
    if cgroup is None:
        argv = [*argv, "--max-tasks", str(task_limit(own_user_namespace=isolation == "bwrap"))]
    if isolation == "none":
        # Its own session, as under bubblewrap, so it must die with its judge by itself.
        argv = [*argv, "--parent", str(os.getpid())]
        env.update(HOME=str(scratch), TMPDIR=str(scratch), TRITON_CACHE_DIR=str(scratch / "triton"))
        cmd, cwd = argv, scratch
    elif isolation == "bwrap":
        prepare_scratch(scratch)
        if drops_privileges():
            lift_host_task_bound()
            argv = [*argv, "--become", str(NOBODY)]
        cmd, cwd = bwrap_command(scratch, argv, gpu=gpu, only_gpu=only_gpu), "/"
    else:
        raise ValueError(f"unknown isolation {isolation!r}; known: 'bwrap', 'none'")
    if cgroup is not None:
        if shutil.which(cmd[0]) is None:  # as Popen would say, not a shell's exit code
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cmd[0])
        cmd = cgroup.wrap(cmd)
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        pass_fds=pass_fds,
        start_new_session=True,
    )


def bwrap_works(gpu: bool = False) -> str | None:
    """None if a sandboxed `true` runs here, else why not (the message bubblewrap gave). Asked
    once per bubblewrap binary (bwrap_path names it) and GPU view."""
    return _bwrap_works(bwrap_path(), gpu)


@functools.cache
def _bwrap_works(binary: str | None, gpu: bool) -> str | None:
    del binary  # the cache's key: bwrap_command finds the same binary
    try:
        with tempfile.TemporaryDirectory(prefix="recforge-bwrap-probe-") as tmp:
            scratch = Path(tmp) / "scratch"
            prepare_scratch(scratch)
            done = subprocess.run(
                bwrap_command(scratch, [sys.executable, "-c", "pass"], gpu=gpu),
                env=runner_env(gpu=gpu),
                capture_output=True,
                text=True,
                timeout=60,
            )
    except IsolationUnavailable as exc:
        return str(exc)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap did not start: {exc}"
    if done.returncode != 0:
        return f"bubblewrap failed (exit {done.returncode}): {done.stderr.strip()[-500:]}"
    return None
