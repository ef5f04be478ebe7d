"""The GPU's locks, shared by every evaluation on one host (judges, backends, campaigns): flock(2)
locks on files in the host's temporary directory, with a turnstile so that an exclusive waiter
keeps new shared holders from starting. Standard library only."""

from __future__ import annotations

import contextlib
import fcntl
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def lock_path(use: str, devices: str) -> Path:
    """The host's `use` lock ("timing" or "memory") of the GPUs `devices` (CUDA_VISIBLE_DEVICES'
    form: one GPU's index, UUID or MIG id, or a list of them; "all" where unset): one file per
    GPU, or per set of GPUs, in the host's temporary directory, shared by every backend and
    campaign there."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", devices.replace(",", "-")) or "none"
    return Path(tempfile.gettempdir()) / f"recforge-{use}-{name}.lock"


@contextlib.contextmanager
def gpu_use(
    lock_path: str | None, *, exclusive: bool, waited: Callable[[float], None] | None = None
) -> Iterator[None]:
    """Use of the GPU behind `lock_path` (nothing when None): shared for checks, which run side by
    side in several evaluations, exclusive for timing, which runs with no check beside it (with
    checks running beside them, embedding-bag timings in a four-worker H200 campaign spread by up
    to 93%, and the noise margin then refused a 2.5x faster kernel). A timer waiting at the
    turnstile keeps new checks from starting, so checks cannot starve it. Both locks are flock(2)
    locks, taken by the judge on its runner's behalf: nothing the runner starts can see the lock
    file (sandbox.isolation), so none can hold it; the kernel releases them when the judge dies.
    `waited` is told the seconds spent waiting for the lock (another evaluation's time, which no
    deadline of this one should count)."""
    if lock_path is None:
        yield
        return
    with open(f"{lock_path}.turnstile", "a") as turnstile, open(lock_path, "a") as gpu:
        t0 = time.monotonic()
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(gpu, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        if waited is not None:
            waited(time.monotonic() - t0)
        try:
            yield
        finally:
            fcntl.flock(gpu, fcntl.LOCK_UN)
