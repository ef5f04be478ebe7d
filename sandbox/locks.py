"""The GPU's locks, shared by every evaluation on one host (judges, backends, campaigns): flock(2)
locks on files in the host's temporary directory, one file per GPU named by what the GPU is (its
UUID, sandbox.gpus.gpu_uuids) rather than by how a process numbers it, with a turnstile so that
an exclusive waiter keeps new shared holders from starting; and the claims by which the judges of
one call time the baselines once per kind of device. Standard library only."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

# One directory for every process of the host whatever its TMPDIR, and one that no runner sees:
# its sandbox has a /tmp of its own (sandbox.isolation), so none can open a lock file to hold it.
LOCK_DIR = Path("/tmp")


def lock_path(use: str, gpu: str) -> Path:
    """The host's `use` lock ("timing" or "memory") of the GPU `gpu` (its UUID; a name as
    CUDA_VISIBLE_DEVICES gives it for GPUs given by name on a host without a CUDA driver): one
    file in LOCK_DIR, shared by every backend and campaign there."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", gpu.replace(",", "-")) or "none"
    return LOCK_DIR / f"recforge-{use}-{name}.lock"


@contextlib.contextmanager
def gpu_use(
    locks: str | Path | Sequence[str | Path] | None,
    *,
    exclusive: bool,
    waited: Callable[[float], None] | None = None,
) -> Iterator[None]:
    """Use of the GPUs behind `locks` (a lock file, or one per GPU; nothing when None or empty),
    each taken in turn in the order of their names, so that evaluations holding sets of GPUs
    that overlap never wait on each other in a circle: shared for checks, which run side by
    side in several evaluations, exclusive for timing, which runs with no check beside it (with
    checks running beside them, embedding-bag timings in a four-worker H200 campaign spread by up
    to 93%, and the noise margin then refused a 2.5x faster kernel). A timer waiting at the
    turnstile keeps new checks from starting, so checks cannot starve it. Both locks are flock(2)
    locks, taken by the judge on its runner's behalf: nothing the runner starts can see the lock
    file (sandbox.isolation), so none can hold it; the kernel releases them when the judge dies.
    `waited` is told the seconds spent waiting for the locks (another evaluation's time, which no
    deadline of this one should count)."""
    paths = sorted({str(locks)} if isinstance(locks, str | Path) else {str(p) for p in locks or ()})
    t0 = time.monotonic()
    with contextlib.ExitStack() as held:
        for path in paths:
            held.enter_context(_held(path, exclusive))
        if waited is not None and paths:
            waited(time.monotonic() - t0)
        yield


@contextlib.contextmanager
def _held(path: str, exclusive: bool) -> Iterator[None]:
    """One GPU's lock, through its turnstile."""
    with open(f"{path}.turnstile", "a") as turnstile, open(path, "a") as gpu:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(gpu, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(gpu, fcntl.LOCK_UN)


class BaselineClaims:
    """Which of one call's evaluations, run side by side, times the baselines on each kind of
    device: the first judge on that kind whose candidate passes every check claims it, by
    creating the kind's file in a directory of the backend's host (O_EXCL: one creator wins);
    the others time none. A call's first evaluations need not wait for the baselines' timing,
    and none of them pays for it twice. The directory is the judges' alone (a runner's sandbox
    has a /tmp of its own and writes nowhere else), and goes when the call ends, or, where its
    process was killed first, when another call starts (its name holds its creator's PID)."""

    PREFIX = "recforge-baselines-"

    def __init__(self) -> None:
        _remove_orphans(Path(tempfile.gettempdir()), self.PREFIX)
        self.path = Path(tempfile.mkdtemp(prefix=f"{self.PREFIX}{os.getpid()}-"))

    def __enter__(self) -> BaselineClaims:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    @staticmethod
    def claim(path: Path, kind: str, evaluation: str) -> bool:
        """Whether `evaluation` (a name no other evaluation of the call has: its scratch
        directory) times the baselines on `kind`: the first to claim it in `path`, or the one
        that did, run again (alone, after its judge ran out of device memory beside others). A
        claim that cannot be written, the directory gone, say, is a won one: timing the
        baselines twice costs time, missing them costs the comparison."""
        file = path / hashlib.sha256(kind.encode()).hexdigest()[:32]
        try:
            fd = os.open(file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            try:
                return file.read_text() == evaluation
            except OSError:
                return False
        except OSError:
            return True
        with contextlib.suppress(OSError), os.fdopen(fd, "w") as out:
            out.write(evaluation)
        return True


def _remove_orphans(root: Path, prefix: str) -> None:
    """Remove the directories `prefix`PID-... in `root` whose process PID has ended (killed before
    it could remove its own). A PID in use again keeps its directory: it is only left longer."""
    for path in root.glob(f"{prefix}*-*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
