"""The GPU's locks, shared by every evaluation on one host (judges, backends, campaigns): flock(2)
locks on files in the host's temporary directory, one file per GPU named by what the GPU is (its
UUID, sandbox.gpus.gpu_uuids) rather than by how a process numbers it, with a turnstile so that
an exclusive waiter keeps new shared holders from starting. Standard library only."""

from __future__ import annotations

import contextlib
import fcntl
import re
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
