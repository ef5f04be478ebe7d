"""The GPUs of this host that the local backend evaluates on, and which one each evaluation gets.

With `gpus` chosen (select_gpus), every GPU is a place of its own: each evaluation's judge sees
that GPU alone (EvalRequest.gpu: the judge sets CUDA_VISIBLE_DEVICES to it before CUDA starts,
and its runner inherits it), and the GPU's timing and memory locks are its own, so timed kernels
on different GPUs run at once while two never share one. Without it, the GPUs this process sees
are one place, as a host with one GPU is. Standard library only (torch is imported when the
GPUs are counted).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sandbox.locks import lock_path

GpuSpec = str | int | list[int] | None  # "all", a count, indices, or None (the visible GPUs as one place)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (an index, a UUID or a
    MIG id), in torch's order; their indices where that variable is unset. Counted through NVML
    where torch can (torch.cuda.device_count creates no CUDA context then), so the campaign's
    process need not hold a GPU to learn what it has."""
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(count)]
    # CUDA reads the list up to its first invalid entry; the count says how many it took.
    return [d.strip() for d in visible.split(",")][:count]


def check_gpus(spec: GpuSpec) -> None:
    """ValueError, in one sentence, for a `gpus` value that no host could take."""
    if spec is None or spec == "all":
        return
    if isinstance(spec, bool) or not isinstance(spec, int | list):
        raise ValueError(f'gpus = {spec!r}: give "all", a number of GPUs, or a list of GPU indices')
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"gpus = {spec}: at least 1 GPU is needed")
        return
    if not spec:
        raise ValueError("gpus = []: the list names no GPU")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in spec):
        raise ValueError(f"gpus = {spec}: GPU indices are whole numbers from 0")
    twice = sorted({i for i in spec if spec.count(i) > 1})
    if twice:
        raise ValueError(f"gpus = {spec} names GPU {twice[0]} more than once")


def select_gpus(spec: GpuSpec, visible: list[str]) -> list[str] | None:
    """The GPUs of `visible` that `spec` names, each to be a place of its own: "all" each of
    them, N the first N, [i, ...] those indices (torch's numbering, within CUDA_VISIBLE_DEVICES);
    None: none chosen, the visible GPUs stay one place. "all" on a host without a GPU is None too
    (nothing changes on a CPU); a count or an index that the host does not have is a ValueError
    that says what it has."""
    check_gpus(spec)
    if spec is None:
        return None
    if spec == "all":
        return list(visible) or None
    have = f"this host shows {len(visible)} GPU(s)"
    if visible != [str(i) for i in range(len(visible))]:  # named otherwise by CUDA_VISIBLE_DEVICES
        have += f" ({', '.join(f'{i} is {name}' for i, name in enumerate(visible))})"
    assert isinstance(spec, int | list)
    if isinstance(spec, int):
        if spec > len(visible):
            raise ValueError(f"gpus = {spec}, but {have}")
        return visible[:spec]
    missing = [i for i in spec if i >= len(visible)]
    if missing:
        raise ValueError(f"gpus = {spec}: no GPU {missing[0]} here; {have}")
    return [visible[i] for i in spec]


# Run with the caller's CUDA environment: the UUID of each GPU the CUDA driver shows, in its
# order (the order of CUDA_VISIBLE_DEVICES, else of CUDA_DEVICE_ORDER), as nvidia-smi writes them;
# a MIG instance's own where the driver has cuDeviceGetUuid_v2. The driver is asked directly,
# with no context made, in a process of its own so that this one never initialises CUDA.
_UUIDS = """
import ctypes, sys
c = ctypes.CDLL("libcuda.so.1")
get = getattr(c, "cuDeviceGetUuid_v2", None) or c.cuDeviceGetUuid
n = ctypes.c_int()
if c.cuInit(0) or c.cuDeviceGetCount(ctypes.byref(n)):
    sys.exit(1)
for i in range(n.value):
    d, u = ctypes.c_int(), (ctypes.c_ubyte * 16)()
    if c.cuDeviceGet(ctypes.byref(d), i) or get(u, d):
        sys.exit(1)
    h = bytes(u).hex()
    print(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
"""


class GpusUnknown(RuntimeError):
    """The CUDA driver could not say which GPUs this host's places are."""


def gpu_uuids() -> list[str] | None:
    """The UUIDs of the GPUs this process may use, in CUDA's order (so index i of visible_gpus is
    uuids[i]); None where the CUDA driver cannot be asked (no GPU, no driver). What a lock file is
    named by: the same GPU is the same file whichever index or name a campaign gives it. An
    answer is kept for the process's life; a failure is asked again next time."""
    key = (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))
    if key not in _KNOWN_UUIDS:
        uuids = _ask_uuids()
        if uuids is None:
            return None
        _KNOWN_UUIDS[key] = uuids
    return list(_KNOWN_UUIDS[key])


_KNOWN_UUIDS: dict[tuple[str | None, str | None], list[str]] = {}


def _ask_uuids() -> list[str] | None:
    try:
        done = subprocess.run([sys.executable, "-c", _UUIDS], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.split() if done.returncode == 0 else None


@dataclass(frozen=True)
class Place:
    """Where one evaluation runs: the GPU its judge sees (as CUDA_VISIBLE_DEVICES names it; None:
    whatever this process sees), the timing and memory locks of the GPUs it may use (one per
    GPU; none: unlocked), and the CPU cores its judge and runner run on (None: every core this
    process may use)."""

    gpu: str | None
    timing_locks: tuple[Path, ...] = ()
    memory_locks: tuple[Path, ...] = ()
    cpus: tuple[int, ...] | None = None
    uuid: str | None = None  # the GPU's, where the driver gave it


def locks_of(gpus: list[str]) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """The timing and memory locks of the GPUs `gpus` (UUIDs, or names where the driver gave
    none)."""
    return tuple(lock_path("timing", g) for g in gpus), tuple(lock_path("memory", g) for g in gpus)


def gpu_place(gpu: str, cpus: tuple[int, ...] | None = None, uuid: str | None = None) -> Place:
    """One GPU as a place, with the locks every backend on this host uses for that GPU: named by
    its `uuid` where known, else by `gpu` as given."""
    timing, memory = locks_of([uuid or gpu])
    return Place(gpu=gpu, timing_locks=timing, memory_locks=memory, cpus=cpus, uuid=uuid)


def host_place() -> Place:
    """The GPUs this process sees (a GPU host's) as one place: the locks of each of them, so an
    evaluation here and one on a single one of them never time at once. GpusUnknown where the
    driver names none: locks named otherwise would keep nothing apart."""
    uuids = gpu_uuids()
    if not uuids:
        raise GpusUnknown(
            "the CUDA driver named no GPU of this host: the locks that keep two campaigns' timings "
            "on one GPU apart are named by each GPU's UUID"
        )
    timing, memory = locks_of(uuids)
    return Place(None, timing, memory)


def split_cpus(parts: int, cpus: set[int] | None = None) -> list[tuple[int, ...]]:
    """The cores this process may use (or `cpus`), in `parts` disjoint runs of consecutive
    cores as even as they go: one per GPU place, so that what a runner does on the CPU (its host
    code, a thread pool, a spin) cannot take the cores from a kernel timed on another GPU. With
    fewer cores than places, the places share them all."""
    cores = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cores) < parts:
        return [tuple(cores)] * parts
    base, extra = divmod(len(cores), parts)
    out, at = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append(tuple(cores[at : at + size]))
        at += size
    return out


class Places:
    """Hands each evaluation a place: the one with the fewest evaluations running, of those with
    fewer than `per_place`, and among those the one that freed first (a candidate goes to
    whichever GPU frees first); waits while every place is full."""

    def __init__(self, places: list[Place], per_place: int) -> None:
        assert places and per_place >= 1
        self.places = places
        self.per_place = per_place
        self._running = [0] * len(places)
        self._freed = [0] * len(places)  # when each last freed, as a count of frees (0: never used)
        self._frees = 0
        self._changed = threading.Condition()

    @property
    def capacity(self) -> int:
        """Evaluations that can run at once."""
        return len(self.places) * self.per_place

    @contextlib.contextmanager
    def use(self) -> Iterator[Place]:
        with self._changed:
            while not (free := [i for i, n in enumerate(self._running) if n < self.per_place]):
                self._changed.wait()
            i = min(free, key=lambda i: (self._running[i], self._freed[i], i))
            self._running[i] += 1
        try:
            yield self.places[i]
        finally:
            with self._changed:
                self._running[i] -= 1
                self._frees += 1
                self._freed[i] = self._frees
                self._changed.notify()
