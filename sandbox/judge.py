"""The trusted side of an evaluation: `python -m sandbox.judge REQUEST.json RESULT.json`.

The judge never imports candidate code. It starts a runner (sandbox.runner) in its sandbox
(sandbox.isolation), draws every input from seeds the runner never sees, writes the inputs into
memory it shares with the runner, runs the reference in its own process, and checks the bytes of
the outputs it copies back; it times batches of calls with its own clock. It alone writes the
EvalResult. Rules, each enforced where it is written below:

- fresh inputs: every call, checked or timed, gets inputs drawn from a fresh seed; no input of a
  timing shape is ever seen twice, so a memo of earlier answers never pays;
- checks on the timed calls: a random subset of the timed calls, drawn after each batch ran (so
  the candidate cannot tell them from the others), is compared with the reference: each call
  with probability CHECKED_SHARE, and at least one a batch. Where the shape's reference takes
  COSTLY_REFERENCE_S or more (a gradient's, seconds a call; timed on the first batch's check,
  with the GPU to itself), after the first batch only one batch drawn before the timing must
  have one. Every timing shape is thus also a check shape at its full size, and a candidate
  idle on all its timed calls is always caught. One idle on k
  calls of a costly shape escapes with probability at most 0.75^k, and it can halve such a
  shape's time (each call counts at its batch's mean) idling on fewer than half of them: at 8
  calls in batches of 2, k = 3, at most 42%;
- the no-op proof, with every Triton launch disabled, runs more than once at random points among
  the checks and the timed batches; each time the output must come out wrong;
- plain outputs: an output is accepted only as the bytes of a tensor of exactly the reference's
  dtype, shape and (contiguous) strides, copied into the judge's memory before it is compared;
- timing from outside: the judge's clock around each batch, which ends only after the runner's
  device-wide synchronize, bounds the per-call event times the runner reports; times that do not
  account for the judge's clock make the result suspicious;
- host compute: every call, timed or not, runs under the runner's watch of torch ops on
  floating-point data (sandbox.host_ops), and before every run the runner fills freed memory
  with NaN: no call can tell a candidate whether it is timed, checked or watched; host code that
  computes the op so is suspicious;
- replies: each request carries a nonce its reply must echo, and nothing may wait on the channel
  before a request: an answer written ahead of "go" cannot stop the clock;
- the runner's failures are statuses: it may die, hang, flood its output, send garbage or exit
  without answering; each becomes a result with a reason, and the judge goes on to write it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import platform
import random
import secrets
import signal
import stat
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sandbox import cgroups, isolation, shared, wire
from sandbox.flush import L2Flush
from sandbox.hardware import roofline_seconds
from sandbox.locks import BaselineClaims, gpu_use
from sandbox.protocol import (
    DEADLINE_MARK,
    EvalRequest,
    Output,
    compare,
    fresh_seed,
    output_tensors,
)
from sandbox.result import LOG_TAIL_CHARS, DeviceInfo, EvalResult, ShapeCheck, ShapeTiming, Status
from sandbox.timing import benchmark, sample_stats
from search_space.problem import DRAWN, Inputs, Problem, Shape, get_problem

NO_OP_PROOFS = 2  # at least this many among the checks, and one more per timing shape
MIN_TIMED_CALLS, MAX_TIMED_CALLS = 8, 48  # per timing shape on a GPU (each on fresh inputs)
TIMED_TARGET_S = 0.3  # of timed calls per shape, within those bounds
# Of the timed calls, the share compared with the reference (and one a batch at least, or where
# the shape's reference costs this many seconds or more, one in the batch drawn for it; see the
# rule above). A gradient's reference at a timing shape takes seconds (gdpa's at b1024-n2048
# 7.5 s on an H100): a shape timed a call a batch would run it after every call.
CHECKED_SHARE = 0.25
COSTLY_REFERENCE_S = 1.0
INTERPRETED_TIMED_CALLS = 3
# How timed batches take the GPU's lock: "shape" (exclusive once for a timing shape's batches and
# the checks between them) or "batch" (each batch alone, exclusive; the checks of its calls,
# shared, between them). Both time every batch with nothing beside it. "shape" lets more
# evaluations an hour through: 747 and 774 against "batch"'s 638, run in the order shape, batch,
# shape on one H100 (`bench sandbox` 20 @4; BENCHMARKS.md, 2026-12-06, twenty-ninth session).
# The local backend passes RECFORGE_TIMING_LOCK to its judges.
TIMING_LOCK = os.environ.get("RECFORGE_TIMING_LOCK", "shape")
if TIMING_LOCK not in ("batch", "shape"):
    raise ValueError(f"RECFORGE_TIMING_LOCK must be 'batch' or 'shape', got {TIMING_LOCK!r}")
# The judge's clock less the runner's event times, per batch, that honest timing leaves over:
# the L2 flush before each call (measured by the judge itself), the host's launch of the flush
# and events per call, the channel's round trip and the batch's final synchronize.
PER_CALL_SLACK_US = 20.0
BATCH_SLACK_US = 500.0
SLACK_FRACTION = 0.1
# A batch whose events account for too little of the judge's clock is timed again, on fresh
# inputs, this many times in all before the candidate is called suspicious: on a loaded host a
# runner or judge descheduled between two calls, or woken late for the reply, leaves such a gap
# once (an honest embedding-bag kernel in a six-worker H200 benchmark), work hidden from the
# events leaves it every time.
AUDIT_ATTEMPTS = 3
# The share of a batch's L2 flushes (the judge's calibration of one, times the calls) that its
# clock must hold beside the calls' event times: less, and the runner skipped them.
FLUSHES_SEEN = 0.5
# A call's inputs start 0 to PLACEMENT_GAPS - 1 alignment units past the previous call's end.
PLACEMENT_GAPS = 16
# Problems draw some settings of a call from its seed's low bits (an index dtype from seed % 2, a
# second one from seed % 4, a launch bound's slack): the warm-up before a shape's timed calls
# makes one call for each residue modulo this, so every specialization a timed call can meet is
# compiled before the clock runs (a jagged concat timed at compile time measured 63 ms a call).
SEED_FORMS = 8


def seed_of_form(form: int, seed: int | None = None) -> int:
    """`seed` (a fresh one if None) with its low bits set to draw the inputs' form `form`."""
    return ((fresh_seed() if seed is None else seed) & ~(SEED_FORMS - 1)) | form


class _EmptyOutput(Exception):
    """The reference's output on a shape is empty or zero: no no-op proof can be made there."""


class Verdict(Exception):
    """Ends the evaluation with `status` and `message` (raised wherever the outcome is known)."""

    def __init__(self, status: Status, message: str, log: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.log = status, message, log


class _Unexplained(Verdict):
    """The audit's finding that a batch's events leave most of the judge's clock unexplained."""


def _own_gpu_node(probed: int | None) -> int | None:
    """The minor number of this judge's one GPU (its evaluation's own, EvalRequest.gpu), where
    a runner sandboxed with that GPU's device node alone sees it (`probed`: the node the backend
    found so, taken where it is this GPU's; else asked here); else None, and the runner gets
    every GPU's node (it could then reach the host's other GPUs: said in the judge's log)."""
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    minor = isolation.gpu_minor(str(uuid)) if uuid is not None else None
    if minor is not None and (minor == probed or isolation.one_gpu_sandbox_works(minor)):
        return minor
    print(f"the runner's sandbox holds every GPU's device node (GPU {uuid}: minor {minor})", file=sys.stderr)
    return None


def _check_own_gpu(request: EvalRequest) -> None:
    """RuntimeError where the judge's one GPU is not the one the backend took the locks of
    (EvalRequest.gpu_uuid): the two read CUDA_VISIBLE_DEVICES' indices differently, and this
    judge would time beside another evaluation. MIG instances, whose UUIDs the two may give in
    different forms, are taken as named."""
    if request.gpu is None or request.gpu_uuid is None or request.gpu.upper().startswith("MIG-"):
        return
    own = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    if own is not None and isolation.uuid_key(str(own)) != isolation.uuid_key(request.gpu_uuid):
        raise RuntimeError(
            f"GPU {request.gpu} is {own} here, not {request.gpu_uuid} as the backend found it "
            "(CUDA_DEVICE_ORDER differs?): its locks are another GPU's"
        )


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name, arch = torch.cuda.get_device_name(device), f"sm_{major}{minor}"
    else:
        name, arch = platform.processor() or "cpu", "interpreter"
    import triton

    return DeviceInfo(
        name=name,
        arch=arch,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        interpreted=device.type != "cuda",
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


# ---- the runner, from the judge's side ------------------------------------------------------


class Deadline:
    """When the evaluation must end (a time.monotonic() value). Waits for the GPU's locks are
    other evaluations' time: each moves the deadline back by its length (`extend`, given to
    sandbox.locks.gpu_use), so a busy GPU makes no honest candidate time out. The runner never
    holds a lock (the judge takes them on its behalf), so it cannot buy itself time this way.
    Each move is written to `mark` (wall-clock seconds since the epoch) for the backend, whose
    hard limit on the judge follows it (sandbox.local)."""

    def __init__(self, seconds: float, mark: Path | None = None) -> None:
        self.at, self.mark = time.monotonic() + seconds, mark

    def left(self) -> float:
        return self.at - time.monotonic()

    def extend(self, seconds: float) -> None:
        if seconds < 0.01:  # an uncontended lock: nothing worth a write
            return
        self.at += seconds
        if self.mark is not None:
            tmp = self.mark.with_suffix(".tmp")
            tmp.write_text(repr(time.time() + self.left()))
            tmp.replace(self.mark)


class RunnerProcess:
    """One sandboxed runner: its channel, its process (or container), the tail of its output."""

    def __init__(self, request: EvalRequest, gpu: bool, deadline: Deadline) -> None:
        self.deadline, self.timeout_s = deadline, request.timeout_s
        limits = []
        if request.cpu_seconds is not None:
            limits += ["--cpu-seconds", str(request.cpu_seconds)]
        if request.address_space_bytes is not None:
            limits += ["--address-space", str(request.address_space_bytes)]
        self.proc: subprocess.Popen | None = None
        self.cgroup: cgroups.RunnerCgroup | None = None
        self.container = None
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_bytes = 0
        self.next_region = 1
        self.bwrap = request.isolation == "bwrap"
        self.stopped: str | None = None  # why the judge stopped the runner, if it did
        self._ended = threading.Event()
        self._killed = False
        if request.isolation == "docker":
            from sandbox.docker_backend import ContainerRunner

            self.container = ContainerRunner(request, limits, gpu=gpu, deadline=deadline.at)
            self.sock = self.container.sock
            self._watch(request)
            return
        self.sock, runner_end = wire.socket_pair()
        argv = [sys.executable, "-P", "-m", "sandbox.runner", str(runner_end.fileno()), *limits]
        # Rule resources (sandbox.isolation): a control group of its own where the host gives one.
        self.cgroup = (
            cgroups.create(
                f"{os.getpid()}-{secrets.token_hex(4)}",
                memory_bytes=isolation.MEMORY_BYTES,
                max_tasks=isolation.TASK_BUDGET,
            )
            if self.bwrap
            else None
        )
        try:
            self.proc = isolation.start_runner(
                argv,
                Path(request.runner_dir),
                gpu=gpu,
                pass_fds=(runner_end.fileno(),),
                stdout=subprocess.PIPE,
                isolation=request.isolation,
                cgroup=self.cgroup,
                only_gpu=_own_gpu_node(request.gpu_node)
                if gpu and self.bwrap and request.gpu is not None
                else None,
            )
        except BaseException:
            if self.cgroup is not None:
                self.cgroup.remove()
            raise
        runner_end.close()
        # Rule failures: whatever the runner prints is drained here and only its tail kept, so
        # flooding fills neither a pipe nor a disk.
        self._drain = threading.Thread(target=self._read_output, daemon=True)
        self._drain.start()
        self._watch(request)

    def _watch(self, request: EvalRequest) -> None:
        """Rule resources (sandbox.isolation): the scratch directory is on the host's disk, so
        the judge looks at what the runner holds there twice a second and stops it beyond its
        quota of bytes (allocated blocks: a sparse file counts for what it uses; with a control
        group, files it unlinked but holds open count too) or files."""
        if request.scratch_bytes is None and request.scratch_files is None:
            return
        max_bytes, max_files = request.scratch_bytes or math.inf, request.scratch_files or math.inf
        root = Path(request.runner_dir)

        def watch() -> None:
            while not self._ended.wait(0.5):
                used, files = _disk_use(root, max_files)
                if self.cgroup is not None:  # and files it unlinked but holds open there
                    used += _held_unlinked(self.cgroup.tasks(), root.stat().st_dev)
                if used > max_bytes or files > max_files:
                    held = f"{used / 2**20:.0f} MiB in {files} files"
                    self.stopped = (
                        f"was stopped: it held {held} in its scratch directory, over its quota of "
                        f"{max_bytes / 2**20:.0f} MiB and {max_files} files"
                    )
                    self._stop()
                    return

        threading.Thread(target=watch, daemon=True).start()

    def _stop(self) -> None:
        """Kill the runner and everything it started (it may be mid-answer: ask() sees a closed
        channel and reports self.stopped)."""
        if self.container is not None:
            self.container.remove()
        else:
            assert self.proc is not None
            # Rule processes (sandbox.isolation): the runner's PID namespace dies with bubblewrap.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self.cgroup is not None:
                self.cgroup.kill()

    def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for chunk in iter(lambda: self.proc.stdout.read1(65536), b""):
            self._tail.append(chunk)
            self._tail_bytes += len(chunk)
            while self._tail_bytes > 4 * LOG_TAIL_CHARS and len(self._tail) > 1:
                self._tail_bytes -= len(self._tail.popleft())

    def log_tail(self) -> str:
        if self.container is not None:
            return self.container.log_tail()[-LOG_TAIL_CHARS:]
        return b"".join(self._tail).decode(errors="replace")[-LOG_TAIL_CHARS:]

    def ask(self, message: dict, fds: tuple[int, ...] = (), *, where: str) -> dict:
        """Send `message`, return the reply; any failure of the runner becomes a Verdict.
        Rule replies: each request carries a fresh nonce that its reply must echo, and nothing
        may wait on the channel before a request is sent, so an answer written ahead (to stop the
        judge's clock at "go" before the calls have run) is refused, never taken for the reply."""
        nonce = secrets.token_hex(8)
        unanswered = None
        try:
            if wire.pending(self.sock):
                text = f"{where}: the runner sent a message nobody asked for"
                unanswered = Verdict(Status.SUSPICIOUS, text)
            else:
                wire.send(self.sock, {**message, "nonce": nonce}, fds)
                reply, extra = wire.receive(self.sock, self.deadline.at)
        except wire.ChannelTimeout:
            unanswered = Verdict(Status.TIMEOUT, f"killed after {self.timeout_s:.0f} s ({where}: no answer)")
        except (wire.ChannelClosed, BrokenPipeError, ConnectionError):
            unanswered = Verdict(Status.RUNTIME_ERROR, f"{where}: the runner {self._how_it_ended()}")
        except wire.BadMessage as exc:
            text = f"{where}: the runner sent an unreadable message ({exc})"
            unanswered = Verdict(Status.RUNTIME_ERROR, text)
        if unanswered is None:
            for fd in extra:  # the judge takes no descriptor from the runner
                with contextlib.suppress(OSError):
                    os.close(fd)
            if reply.get("re") != nonce:
                text = f"{where}: the runner answered a request it was not sent"
                unanswered = Verdict(Status.SUSPICIOUS, text)
        if unanswered is not None:
            # Rule locks: a runner that did not answer (it hangs, crashed mid-call, or speaks out
            # of turn) may still have work on the GPU, so it is gone, its CUDA context with it,
            # before the caller releases the lock it holds for the request (Session.gpu): no
            # other evaluation times beside what it left running. An answer, error or not, comes
            # after the runner's synchronize.
            self.kill()
            raise unanswered
        if reply.get("ok") is True:
            return reply
        error = reply.get("error") if isinstance(reply.get("error"), dict) else {}
        status = Status.COMPILE_ERROR if error.get("kind") == "compile_error" else Status.RUNTIME_ERROR
        text = str(error.get("message", "the runner refused the request"))[:2000]
        if error.get("kind") == "host_compute":  # rule host compute: what the watch found, then an error
            status = Status.SUSPICIOUS
            text = (
                f"host code computed on floating-point tensors with {text}: the op must be computed by "
                "its Triton kernels"
            )
        raise Verdict(status, f"{where}: {text}", log=str(error.get("traceback", ""))[-LOG_TAIL_CHARS:])

    def _how_it_ended(self) -> str:
        if self.stopped is not None:
            return self.stopped
        if self.cgroup is not None and self.cgroup.killed_at_memory_limit():
            return f"was killed at its memory limit of {self.cgroup.memory_bytes / 2**30:.0f} GiB"
        if self.container is not None:
            return self.container.how_it_ended()
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "closed its channel"
        if code == 0:
            return "exited without answering"
        if code < 0:
            return f"died (signal {signal.Signals(-code).name})"
        # bubblewrap reports its child's death by signal N as exit code 128 + N.
        if self.bwrap and code > 128:
            with contextlib.suppress(ValueError):
                return f"died (signal {signal.Signals(code - 128).name})"
        return f"died (exit code {code})"

    def share(
        self, region: shared.Region, fd: int, device: str, *, writable: bool = True, updated: bool = False
    ) -> int:
        """Hand `region` to the runner; one of inputs is not `writable` there (rule read-only
        inputs: sandbox.shared.import_region, sandbox.host_ops), one of arguments the op updates
        in place is writable and `updated` (its kernels may write it)."""
        rid = self.next_region
        self.next_region += 1
        try:
            message = {
                "op": "region",
                "id": rid,
                "device": device,
                "nbytes": region.nbytes,
                "writable": writable,
                "updated": updated,
            }
            self.ask(message, (fd,), where="share")
        finally:
            os.close(fd)
        return rid

    def kill(self) -> None:
        """The runner and everything it started stopped, and waited for until gone; once."""
        if self._killed:
            return
        self._killed = True
        self._ended.set()
        self._stop()
        if self.proc is not None:
            self.proc.wait()
            self._drain.join(timeout=5)
        if self.cgroup is not None:
            self.cgroup.remove()
        self.sock.close()


def _held_unlinked(pids: list[int], device: int) -> int:
    """Bytes allocated to regular files on filesystem `device` (the scratch directory's) that
    `pids` hold open after unlinking them: out of the directory's listing, still on the disk."""
    used, seen = 0, set()
    for pid in pids:
        try:
            fds = os.scandir(f"/proc/{pid}/fd")
        except OSError:
            continue  # it ended meanwhile
        with fds:
            for fd in fds:
                try:
                    st = os.stat(fd.path)
                except OSError:
                    continue
                unlinked = stat.S_ISREG(st.st_mode) and st.st_nlink == 0 and st.st_dev == device
                if unlinked and (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    used += st.st_blocks * 512
    return used


def _disk_use(root: Path, max_files: float) -> tuple[int, int]:
    """Bytes allocated to the files under `root` and how many there are, counting no further
    than one past `max_files`."""
    used = files = 0
    stack = [str(root)]
    while stack and files <= max_files:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            files += 1
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                used += entry.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                continue  # removed meanwhile
    return used, files


# ---- calls: inputs in shared memory, outputs copied back -------------------------------------


@dataclass
class Call:
    """One call of the candidate: the shape, its inputs (the judge's own copy, drawn from a seed
    the runner never sees), and where they lie in the shared region."""

    shape: Shape
    inputs: Inputs
    args: list = field(default_factory=list)  # the runner's encoding of each argument
    kwargs: dict = field(default_factory=dict)
    views: list[torch.Tensor] = field(default_factory=list)  # the shared region's copy of each tensor
    id: int = 0


def _layout(inputs: Inputs, keep: list[bool] | None = None) -> int:
    """Bytes the inputs' tensors take in a shared region (those `keep` marks, where given)."""
    tensors = inputs.tensors()
    kept = keep if keep is not None else [True] * len(tensors)
    return sum(shared.aligned(t.numel() * t.element_size()) for t, k in zip(tensors, kept, strict=True) if k)


def _encode(value, region: shared.Region, rid: int, cursor: list[int], call: Call):
    """The runner's description of one argument, a tensor placed in `region` at `cursor` (and
    written there by Session.write)."""
    if isinstance(value, torch.Tensor):
        t = value
        offset = cursor[0]
        view = region.view(offset, t.dtype, t.shape, shared.contiguous_strides(t.shape))
        call.views.append(view)
        cursor[0] += shared.aligned(t.numel() * t.element_size())
        return {"t": {"region": rid, "offset": offset, "dtype": shared.dtype_name(t.dtype),
                      "shape": list(t.shape), "strides": list(view.stride())}}  # fmt: skip
    if value is None or isinstance(value, bool | int | float | str):
        return {"v": value}
    if isinstance(value, list | tuple) and all(isinstance(v, bool | int | float | str) for v in value):
        return {"v": list(value)}
    raise TypeError(f"cannot pass an argument of type {type(value).__name__} to the runner")


class Session:
    """The judge's side of one evaluation's calls."""

    def __init__(
        self,
        runner: RunnerProcess,
        problem: Problem,
        device: torch.device,
        locks: list[str],
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        self.runner, self.problem, self.device, self.locks = runner, problem, device, locks
        self.on_wait = on_wait
        self.held_s: collections.Counter[str] = collections.Counter()  # EvalResult.gpu_held_s
        self._exclusive = False  # inside an exclusive hold: gpu() takes nothing more
        self.kind = "cuda" if device.type == "cuda" else "cpu"
        self.next_call = 1
        self.input_region: tuple[shared.Region, int] | None = None
        # The arguments an op updates in place (Problem.updates): writable by the runner.
        self.updated_region: tuple[shared.Region, int] | None = None

    @contextlib.contextmanager
    def gpu(self, *, exclusive: bool) -> Iterator[None]:
        """The GPUs' locks, taken on the runner's behalf (sandbox.locks): exclusive for timing,
        shared for everything else; the wait for them does not count against the deadline, and
        is told to `on_wait` (the evaluation's phase clock). The time held is counted in held_s.
        Inside an exclusive hold (TIMING_LOCK "shape") it takes nothing: the GPU is this
        evaluation's already."""
        if self._exclusive:
            yield
            return
        with gpu_use(self.locks, exclusive=exclusive, waited=self._waited):
            t0 = time.perf_counter()
            self._exclusive = exclusive
            try:
                yield
            finally:
                self._exclusive = False
                if self.locks:
                    self.held_s["exclusive" if exclusive else "shared"] += time.perf_counter() - t0

    def _waited(self, seconds: float) -> None:
        self.runner.deadline.extend(seconds)
        if self.on_wait is not None:
            self.on_wait(seconds)

    def _input_region(self, nbytes: int, *, updated: bool = False) -> tuple[shared.Region, int]:
        """The region of the calls' read-only inputs, or of the arguments they update, at least
        `nbytes` long."""
        slot = "updated_region" if updated else "input_region"
        held = getattr(self, slot)
        if held is not None and held[0].nbytes >= nbytes:
            return held
        if held is not None:
            self.drop(regions=[held[1]])
            held[0].close()
        region, fd = shared.create_region(self.kind, max(nbytes, 1))
        rid = self.runner.share(region, fd, self.kind, writable=updated, updated=updated)
        setattr(self, slot, (region, rid))
        return region, rid

    def place(
        self,
        shape: Shape,
        n: int,
        *,
        write: bool = True,
        other_form: bool = False,
        parity: int | None = None,
        residues: list[int] | None = None,
        copies: bool = False,
    ) -> list[Call]:
        """Inputs of `n` calls, each drawn here from a fresh seed and placed in the shared input
        region (each call's tensors at their own offsets); written there now, or by `write` later.
        `other_form`: the calls in the forward's other form (Problem.in_other_form); `parity`:
        seeds of that parity, whose settings a shape draws per call take their other value on the
        other parity (search_space.attention_common.drawn_scale); `residues`: call i's seed is
        residues[i] modulo SEED_FORMS; `copies`: the calls on copies of one draw of inputs."""
        seeds = [fresh_seed() for _ in range(1 if copies else n)]
        if parity is not None:
            seeds = [(seed & ~1) | parity for seed in seeds]
        if residues is not None:
            seeds = [seed_of_form(r, seed) for seed, r in zip(seeds, residues, strict=True)]
        sets = [self.problem.make_inputs(shape, seed, self.device) for seed in seeds]
        if copies:
            sets = [sets[0], *(sets[0].clone() for _ in range(n - 1))]
        if other_form:
            sets = [self.problem.in_other_form(s) for s in sets]
        # Arguments the op updates in place go to a writable region of their own.
        flags = [self.problem.updated(s) for s in sets]
        # Rule checks on the timed calls: where a call's inputs lie tells nothing of its kind.
        # Each call goes to the region in a random order after a random gap, whether it is
        # checked alone or timed in a batch (packed back to back, a batch's later calls began
        # exactly where another call's inputs ended, and a lone check never did).
        gaps = [secrets.randbelow(PLACEMENT_GAPS) * shared.ALIGN for _ in sets]
        read_only = [[not u for u in f] for f in flags]
        places = [self._input_region(sum(map(_layout, sets, read_only)) + sum(gaps))]
        if self.problem.updates:
            updated_gaps = [secrets.randbelow(PLACEMENT_GAPS) * shared.ALIGN for _ in sets]
            places.append(
                self._input_region(sum(map(_layout, sets, flags)) + sum(updated_gaps), updated=True)
            )
        calls = [Call(shape=shape, inputs=inputs) for inputs in sets]
        for call in calls:
            call.id = self.next_call
            self.next_call += 1
        cursors = [[0], [0]]
        for i in random.SystemRandom().sample(range(len(calls)), len(calls)):
            call, inputs = calls[i], sets[i]
            cursors[0][0] += gaps[i]
            if self.problem.updates:
                cursors[1][0] += updated_gaps[i]
            at = iter(flags[i])

            def encode(value, call=call, at=at):
                where = int(next(at)) if isinstance(value, torch.Tensor) else 0
                return _encode(value, *places[where], cursors[where], call)

            call.args = [encode(a) for a in inputs.args]
            call.kwargs = {k: encode(v) for k, v in inputs.kwargs.items()}
        if write:
            self.write(calls)
        return calls

    def write(self, calls: list[Call]) -> None:
        for call in calls:
            for view, t in zip(call.views, call.inputs.tensors(), strict=True):
                view.copy_(t)
        if self.kind == "cuda":
            torch.cuda.synchronize()  # the inputs are in memory before the runner reads them

    def run(self, calls: list[Call], *, noop: bool = False, poison: int = 0, where: str) -> list[dict]:
        """Untimed calls (checks, no-op proofs), watched: what each returned, as the runner
        describes it."""
        message = self._message(calls, timed=False, noop=noop, poison=poison, watch=True)
        reply = self.runner.ask(message, where=where)
        return self._by_call(calls, reply.get("calls"), where)

    def run_timed(self, calls: list[Call], *, where: str, poison: int = 0) -> tuple[float, list, list[dict]]:
        """A timed batch, watched as every call is: the judge's clock in microseconds from its
        "go" to the runner's answer (which comes after the runner's device-wide synchronize), the
        runner's per-call times, and what each call returned. `poison`: bytes per call the runner
        fills with NaN before it gets ready (outside the clock)."""
        # The runner's poison runs on the device before it gets ready: never beside another
        # evaluation's timed batch (the shared lock).
        with self.gpu(exclusive=False):
            ready = self.runner.ask(self._message(calls, timed=True, poison=poison, watch=True), where=where)
        if ready.get("ready") is not True:
            raise Verdict(Status.RUNTIME_ERROR, f"{where}: the runner did not get ready to time")
        with self.gpu(exclusive=True):
            # The inputs reach the shared region only now, just before "go": a runner that got
            # ready early has nothing to compute ahead of the clock.
            self.write(calls)
            t0 = time.perf_counter()
            reply = self.runner.ask({"op": "go"}, where=where)
            wall_us = (time.perf_counter() - t0) * 1e6
        times = reply.get("times")
        if not isinstance(times, list) or len(times) != len(calls):
            raise Verdict(Status.RUNTIME_ERROR, f"{where}: the runner reported no times")
        described = self.runner.ask({"op": "describe", "ids": [c.id for c in calls]}, where=where)
        return wall_us, times, self._by_call(calls, described.get("calls"), where)

    @staticmethod
    def _message(
        calls: list[Call], *, timed: bool, noop: bool = False, poison: int = 0, watch: bool = False
    ) -> dict:
        return {
            "op": "run",
            "calls": [{"id": c.id, "args": c.args, "kwargs": c.kwargs} for c in calls],
            "timed": timed,
            "noop": noop,
            "poison_bytes": poison,
            "watch": watch,
        }

    @staticmethod
    def _by_call(calls: list[Call], items, where: str) -> list[dict]:
        by_id = {}
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and isinstance(item.get("id"), int):
                by_id[item["id"]] = item
        if set(by_id) != {c.id for c in calls}:
            raise Verdict(
                Status.RUNTIME_ERROR, f"{where}: the runner answered for other calls than it was given"
            )
        for item in by_id.values():
            # Rule host compute (sandbox.host_ops): the op is computed by the kernels.
            if item.get("host_compute"):
                raise Verdict(
                    Status.SUSPICIOUS,
                    f"{where}: host code computed on floating-point tensors with "
                    f"{str(item['host_compute'])[:200]}: the op must be computed by its Triton kernels",
                )
        return [by_id[c.id] for c in calls]

    def fetch(self, call: Call, described: dict, ref: Output, where: str) -> Output:
        """The call's outputs, as tensors in the judge's own memory, after checking that the
        runner describes exactly the reference's structure (rule plain outputs). For an op that
        updates its arguments in place, those arguments as the call left them."""
        refs = output_tensors(ref)
        problem = described.get("problem")
        if isinstance(problem, str):
            raise Verdict(Status.WRONG, f"{where}: {problem[:500]}")
        outs = described.get("outputs")
        if self.problem.updates:
            if outs != [] or described.get("none") is not True:
                got = (
                    f"{len(outs)} tensors" if isinstance(outs, list) and outs else "something other than None"
                )
                raise Verdict(
                    Status.WRONG,
                    f"{where}: returned {got}; an op that updates its arguments in place returns None",
                )
            # Copied out at once, as outputs are: the judge compares its own memory.
            updated = self.problem.updated(call.inputs)
            return tuple(v.clone() for v, u in zip(call.views, updated, strict=True) if u)
        if (
            not isinstance(outs, list)
            or len(outs) != len(refs)
            or (isinstance(ref, tuple) and not described.get("tuple"))
        ):
            got = f"{len(outs)} tensors" if isinstance(outs, list) else "nothing"
            want = f"a tuple of {len(refs)} tensors" if isinstance(ref, tuple) else "one tensor"
            raise Verdict(Status.WRONG, f"{where}: returned {got}, expected {want}")
        for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
            expected = {"dtype": shared.dtype_name(r.dtype), "shape": list(r.shape), "device": self.kind}
            got = {k: o.get(k) if isinstance(o, dict) else None for k in expected}
            label = f"output {i}: " if len(refs) > 1 else ""
            if got != expected:
                raise Verdict(
                    Status.WRONG,
                    f"{where}: {label}returned {str(got['shape'])[:100]} {str(got['dtype'])[:40]} on "
                    f"{str(got['device'])[:40]}, expected {list(r.shape)} {expected['dtype']} on {self.kind}",
                )
            want_strides = shared.contiguous_strides(r.shape)
            strides = o.get("strides")
            if (
                not isinstance(strides, list)
                or any(n > 1 and s != w for n, s, w in zip(r.shape, strides, want_strides, strict=False))
                or len(strides) != len(want_strides)
            ):
                raise Verdict(
                    Status.WRONG,
                    f"{where}: {label}returned strides {strides}, expected contiguous {list(want_strides)}",
                )
        sizes = [shared.aligned(r.numel() * r.element_size()) for r in refs]
        region, fd = shared.create_region(self.kind, sum(sizes))
        rid = self.runner.share(region, fd, self.kind)
        try:
            items, offsets, cursor = [], [], 0
            for i, size in enumerate(sizes):
                items.append({"call": call.id, "output": i, "offset": cursor})
                offsets.append(cursor)
                cursor += size
            self.runner.ask({"op": "fetch", "region": rid, "items": items}, where=where)
            # Copied out at once: the judge compares its own memory, which the runner cannot reach.
            got = [
                region.view(off, r.dtype, r.shape, shared.contiguous_strides(r.shape)).clone()
                for off, r in zip(offsets, refs, strict=True)
            ]
        finally:
            self.drop(regions=[rid])
            region.close()
        return tuple(got) if isinstance(ref, tuple) else got[0]

    def drop(self, *, calls: list[Call] = (), regions: list[int] = ()) -> None:
        self.runner.ask(
            {"op": "drop", "calls": [c.id for c in calls], "regions": list(regions)}, where="drop"
        )

    def inputs_unchanged(self, call: Call, pristine: Inputs) -> bool:
        """Whether the runner left the call's inputs as they were placed, but those it updates."""
        updated = self.problem.updated(pristine)
        return all(
            u or torch.equal(v, p.contiguous())
            for v, p, u in zip(call.views, pristine.tensors(), updated, strict=True)
        )


# ---- the evaluation -------------------------------------------------------------------------


def _nbytes(out: Output) -> int:
    return sum(t.numel() * t.element_size() for t in output_tensors(out))


def _nonzero_output(shape: Shape) -> bool:
    lengths = shape.params.get("lengths")
    return lengths is None or sum(lengths) > 0


def checked_calls(rng: random.Random, n: int, *, must: bool) -> list[int]:
    """Which of a timed batch's `n` calls are compared with the reference: each with probability
    CHECKED_SHARE, and one at random where none was drawn and the batch `must` have one."""
    chosen = [i for i in range(n) if rng.random() < CHECKED_SHARE]
    return chosen or ([rng.randrange(n)] if must else [])


class Evaluation:
    def __init__(self, request: EvalRequest, clock: PhaseClock | None = None) -> None:
        self.request = request
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.problem = get_problem(request.problem)
        self.rng = random.SystemRandom()  # the schedule, like the seeds, is not the runner's to know
        self.checks: list[ShapeCheck] = []
        self.clock = clock if clock is not None else PhaseClock()
        self.reference_s = 0.0  # the last check's reference, in seconds (its cost on this device)
        self.session: Session | None = None
        self._set_bytes: dict[tuple[str, str], int] = {}  # by (shape name, dtype)
        self._out_bytes: dict[tuple[str, str], int] = {}

    def set_bytes(self, shape: Shape) -> int:
        """Bytes one call's inputs take in the shared region (from one draw of them)."""
        key = (shape.name, shape.dtype)
        if key not in self._set_bytes:
            self._set_bytes[key] = _layout(self.problem.make_inputs(shape, 0, self.device))
        return self._set_bytes[key]

    # Each check compares fresh-input outputs with the reference, computed here on the judge's
    # own copy of the inputs, and checks the runner left the shared inputs unchanged.
    def check(self, calls: list[Call], outputs: list[dict], trial: int, *, where: str) -> list[Output]:
        assert self.session is not None
        got_all = []
        for call, described in zip(calls, outputs, strict=True):
            pristine = call.inputs
            ref_inputs = pristine.clone()
            t0 = time.perf_counter()
            ref = self.problem.result(
                ref_inputs, self.problem.reference(*ref_inputs.args, **ref_inputs.kwargs)
            )
            if self.device.type == "cuda":  # the runner synchronized before it answered
                torch.cuda.synchronize(self.device)
            self.reference_s = time.perf_counter() - t0  # the judge's own work alone
            key = (call.shape.name, call.shape.dtype)
            # An update's outputs are its inputs, placed fresh for every call: nothing to poison.
            made = 0 if self.problem.updates else _nbytes(ref)
            self._out_bytes[key] = max(self._out_bytes.get(key, 0), made)
            got = self.session.fetch(call, described, ref, where)
            base = {"shape": call.shape.name, "dtype": call.shape.dtype, "trial": trial}
            if not self.session.inputs_unchanged(call, pristine):
                self.checks.append(ShapeCheck(**base, ok=False, message="the candidate modified its inputs"))
                raise Verdict(Status.WRONG, f"{where}: the candidate modified its inputs")
            ok, details = compare(got, ref, *self.problem.closeness(call.shape.dtype, pristine, ref))
            wrong = self.problem.verify(pristine, got) if ok and self.problem.verify is not None else None
            if wrong is not None:
                ok, details = False, {**details, "message": wrong}
            self.checks.append(ShapeCheck(**base, ok=ok, **details))
            if not ok:
                raise Verdict(Status.WRONG, f"{where}: {details['message']}")
            got_all.append(got)
        return got_all

    def batch_calls(self, shape: Shape) -> int:
        """Calls in one timed batch, up to 8: as many as the region budget holds, each with its
        inputs and the poison the runner reserves for it before the batch (poison_bytes: twice
        its output, which it holds until the batch's checks, at least). A dense gradient of
        every table (GBs a call) is timed a few calls a batch."""
        per_call = self.set_bytes(shape) + self.poison_bytes(shape)  # twice the output, at least
        return max(1, min(8, self.request.region_budget_bytes // per_call))

    def poison_bytes(self, shape: Shape) -> int:
        """How much freed memory the runner fills with NaN per call, before checked and timed calls
        alike: twice the largest output seen for the shape (its inputs' size before any is), so
        an element the candidate never writes is NaN."""
        seen = self._out_bytes.get((shape.name, shape.dtype))
        return 2 * (seen if seen is not None else self.set_bytes(shape)) + (1 << 20)

    def note_output_bytes(self, shape: Shape, described: list[dict]) -> None:
        """The outputs' size as the runner describes them (a warm-up's), for poison_bytes: the
        runner's word, bounded by four times the inputs' size."""
        total = 0
        for d in described:
            outs = d.get("outputs") if isinstance(d.get("outputs"), list) else []
            size = 0
            for o in outs:
                if not isinstance(o, dict) or not isinstance(o.get("dtype"), str):
                    continue
                dims, dtype = o.get("shape"), shared.DTYPES.get(o["dtype"])
                if isinstance(dims, list) and all(isinstance(n, int) and n >= 0 for n in dims) and dtype:
                    size += math.prod(dims) * dtype.itemsize
            total = max(total, size)
        key = (shape.name, shape.dtype)
        self._out_bytes[key] = max(self._out_bytes.get(key, 0), min(total, 4 * self.set_bytes(shape)))

    def check_shape(self, shape: Shape, trial: int) -> None:
        """Trial 0 calls twice on the same inputs (the two outputs must agree within the
        tolerance: results that depend on call history fail); later trials once, on new inputs.
        Odd trials call the forward in its other form (with the statistics where the shape asks
        for the output alone, and the reverse): every check shape is checked in both."""
        assert self.session is not None
        other_form = trial % 2 == 1 and self.problem.statistics is not None
        # Trial 0's second call is on the same inputs: the same placement, or for an op that
        # updates its arguments, a copy of them placed apart (the first call changed its own).
        twice = trial == 0 and bool(self.problem.updates)
        call, *twin = self.session.place(
            shape, 2 if twice else 1, other_form=other_form, parity=trial % 2, copies=twice
        )
        # What the call drew (a scale, say), so that a failure can be reproduced.
        drawn = [f"{k}={call.inputs.kwargs.get(k)}" for k, v in shape.params.items() if v == DRAWN]
        where = (
            shape.describe() + "".join(f", {d}" for d in drawn) + (", the other form" if other_form else "")
        )
        calls = [call] if trial else [call, *(twin or [dataclasses.replace(call, id=call.id + 10**9)])]
        outputs = self.session.run(calls, poison=self.poison_bytes(shape), where=where)
        got = self.check(calls[:1], outputs[:1], trial, where=where)
        if trial == 0:
            second = self.check(
                calls[1:], outputs[1:], trial, where=f"{where}, second call on the same inputs"
            )
            tol, _ = self.problem.closeness(shape.dtype, call.inputs, got[0])
            again, _ = compare(second[0], got[0], tol, None)
            if not again:
                self.checks.append(ShapeCheck(shape=shape.name, dtype=shape.dtype, trial=trial, ok=False,
                                              message="two runs on the same inputs disagree"))  # fmt: skip
                raise Verdict(Status.WRONG, f"{where}: two runs on the same inputs disagree")
        self.session.drop(calls=calls)

    def no_op_proof(self, shape: Shape) -> None:
        """With every Triton launch a no-op, the output must be wrong: otherwise something other
        than the candidate's kernels computed it. A candidate that raises instead gave no output
        without them, which counts as a wrong one (its host code read what a disabled kernel never
        wrote); a CUDA error stays an error. (One that detects its disabled kernels can always
        give a wrong output here on purpose: the proof catches fallbacks that do not, and the
        screen's allowlist the torch functions that would compute the op.)"""
        assert self.session is not None
        (call,) = self.session.place(shape, 1)
        (described,) = self.session.run(
            [call], noop=True, poison=self.poison_bytes(shape), where="no-op proof"
        )
        proof = dict(shape=shape.name, dtype=shape.dtype, trial=-1)
        if "raised" in described:
            message = f"no output with every Triton kernel disabled ({described['raised']})"
            self.checks.append(ShapeCheck(**proof, ok=True, message=message[:200]))
            return
        pristine = call.inputs
        ref_inputs = pristine.clone()
        ref = self.problem.result(ref_inputs, self.problem.reference(*ref_inputs.args, **ref_inputs.kwargs))
        if not any(t.numel() and bool(t.ne(0).any()) for t in output_tensors(ref)) or (
            self.problem.updates and all(map(torch.equal, ref, self.problem.result(pristine, None)))
        ):
            # Empty or all zeros (no candidates, say), or an update that changes nothing (no ids):
            # a candidate with no kernel gets it right.
            self.session.drop(calls=[call])
            raise _EmptyOutput
        try:
            got = self.session.fetch(call, described, ref, "no-op proof")
        except Verdict as verdict:  # a malformed output without kernels is a wrong one
            if verdict.status != Status.WRONG:
                raise
            self.checks.append(ShapeCheck(**proof, ok=True, message="no well-formed output without kernels"))
            return
        finally:
            self.session.drop(calls=[call])
        still_ok, _ = compare(got, ref, *self.problem.closeness(shape.dtype, pristine, ref))
        if still_ok:
            message = "output is still correct with every Triton kernel disabled"
            self.checks.append(ShapeCheck(**proof, ok=False, message=message))
            raise Verdict(Status.SUSPICIOUS, f"{message}: the op was not computed by its kernels")
        self.checks.append(ShapeCheck(**proof, ok=True))

    def run_checks(self) -> None:
        steps: list[tuple] = [
            ("check", shape, trial)
            for shape in self.problem.check_shapes
            for trial in range(max(2, self.request.trials))
        ]
        # Rule no-op proof: at random points among the checks, never only last.
        nonzero = [s for s in self.problem.check_shapes if _nonzero_output(s)]
        for _ in range(NO_OP_PROOFS):
            steps.insert(self.rng.randrange(len(steps) + 1), ("noop", self.rng.choice(nonzero), -1))
        for kind, shape, trial in steps:
            with self.session.gpu(exclusive=False):
                if kind == "check":
                    self.check_shape(shape, trial)
                else:
                    self.some_no_op_proof(shape, nonzero)

    def some_no_op_proof(self, first: Shape, shapes: list[Shape]) -> None:
        """A no-op proof on `first`, or, where its output is empty (no candidates, say), on
        another of `shapes`."""
        for shape in [first, *self.rng.sample(shapes, len(shapes))]:
            try:
                return self.no_op_proof(shape)
            except _EmptyOutput:
                continue
        raise Verdict(Status.RUNTIME_ERROR, "no check shape has a non-empty output for the no-op proof")

    # -- timing --------------------------------------------------------------------------------

    def time_shapes(self, device: DeviceInfo) -> list[ShapeTiming]:
        """The candidate's timings on every timing shape, with the baselines asked for, unless
        the caller holds them for this kind of device already (EvalRequest.baselines_held_on)."""
        assert self.session is not None
        gpu = self.device.type == "cuda"
        shapes = self.problem.timing_shapes if gpu else self.problem.interpreted_timing_shapes
        calibration = None
        if gpu:
            with self.session.gpu(exclusive=True):  # flushes the L2: nothing beside
                calibration = Calibration.measure(self.session.runner, self.device)
        names = self.request.baselines if self.times_baselines(device) else []
        baselines = baseline_providers(self.problem, names, self.device)
        timings = []
        for shape in shapes:
            timings.append(self.time_shape(shape, device.arch, calibration, baselines))
            if gpu:
                torch.cuda.empty_cache()
        return timings

    def times_baselines(self, device: DeviceInfo) -> bool:
        """Whether this judge times the baselines asked for: not on a kind the caller holds them
        for, and, among judges of one call that claim them (EvalRequest.baselines_claims), only
        the first on its kind to get here, its candidate through every check (or it again, the
        same evaluation run once more alone)."""
        if not self.request.baselines or device.kind in self.request.baselines_held_on:
            return False
        if self.request.baselines_claims is None:
            return True
        return BaselineClaims.claim(Path(self.request.baselines_claims), device.kind, self.request.runner_dir)

    def timed_batch(
        self, shape: Shape, n: int, calibration: Calibration | None
    ) -> tuple[list[Call], float, list, list, list[dict]]:
        """`n` calls on fresh inputs, timed: (calls, the judge's clock in us, the runner's times,
        those times as the audit accounts them (Calibration.audit; the runner's own on the
        interpreter), what each call returned). A batch the audit finds unexplained
        (_Unexplained) is dropped and timed again on fresh inputs, up to AUDIT_ATTEMPTS batches."""
        assert self.session is not None
        where = f"timing {shape.describe()}"
        for attempt in range(AUDIT_ATTEMPTS):
            with self.session.gpu(exclusive=False):
                calls = self.session.place(shape, n, write=False)
            wall_us, times, described = self.session.run_timed(
                calls, where=where, poison=self.poison_bytes(shape)
            )
            for d in described:  # the runner's own findings (aliasing, a subclass) fail any call
                if isinstance(d.get("problem"), str):
                    raise Verdict(Status.WRONG, f"{where}: {d['problem'][:500]}")
            if not all(_a_time(t) for t in times):
                raise Verdict(Status.RUNTIME_ERROR, f"{where}: the runner reported no times")
            if calibration is None:
                return calls, wall_us, times, times, described
            try:
                audited = calibration.audit(shape, wall_us, times)
            except _Unexplained as finding:
                if attempt + 1 == AUDIT_ATTEMPTS:
                    raise Verdict(finding.status, f"{finding.message} ({AUDIT_ATTEMPTS} batches)") from None
                with self.session.gpu(exclusive=False):
                    self.session.drop(calls=calls)
                continue
            return calls, wall_us, times, audited, described
        raise AssertionError("unreachable")

    def time_shape(
        self, shape: Shape, arch: str, calibration: Calibration | None, baselines: dict
    ) -> ShapeTiming:
        assert self.session is not None
        gpu = calibration is not None
        samples: list[float] = []
        outside_us = accounted_us = 0.0
        checked = 0
        target = MAX_TIMED_CALLS if gpu else INTERPRETED_TIMED_CALLS
        # Warm-up, untimed: compiling and autotuning at this shape happen here, not in a timed
        # call, for each form of input its seeds draw (SEED_FORMS); the first form alone, whose
        # output's size sizes the batches after it (batch_calls). The judge's own device work in
        # the timing phase (drawing inputs, the reference, copies of outputs, the no-op proof)
        # holds the shared lock, as the checks do: none of it runs beside another evaluation's
        # timed batch.
        residues = list(range(SEED_FORMS if gpu else 2))
        at, per_batch = 0, 1
        while at < len(residues):
            forms = residues[at : at + per_batch]
            with self.session.gpu(exclusive=False):
                warm = self.session.place(shape, len(forms), residues=forms)
                self.note_output_bytes(shape, self.session.run(warm, where=f"warm-up {shape.describe()}"))
                self.session.drop(calls=warm)
                per_batch = self.batch_calls(shape)
            at += len(forms)
        proof_at = self.rng.randrange(max(1, target // per_batch))  # rule no-op proof, in timing too
        # Rule checks on the timed calls: on a costly shape, the batch with a call always checked,
        # among the batches every shape runs (those of its MIN_TIMED_CALLS).
        checked_at = self.rng.randrange(-(-MIN_TIMED_CALLS // per_batch)) if gpu else 0
        costly = False  # known once the first batch's calls have been checked
        training = self.problem.optimizes != "forward" or self.problem.wants_statistics(warm[0].inputs)
        # Rule host compute: every timed call runs under the watch (sandbox.host_ops), as every
        # untimed one does, and before each batch the runner fills freed memory as it does
        # before checks: the watch does not tell a candidate whether a call is timed, checked or
        # watched (in-process watches can be detected; one that is always on need not be). Its
        # overhead is in every candidate's times alike, the incumbent's too. (Other things can
        # tell: a timed batch holds up to 8 outputs at once, a check one or two, so their
        # addresses differ. That is why timed calls are checked at random, never trusted.)
        batch_index = 0
        # TIMING_LOCK "shape": the shape's batches and the checks between them under one exclusive
        # hold (every gpu() inside it then takes nothing); "batch": each takes its own.
        with self.session.gpu(exclusive=True) if TIMING_LOCK == "shape" else contextlib.nullcontext():
            while True:
                enough = len(samples) >= target or (
                    gpu and len(samples) >= MIN_TIMED_CALLS and sum(samples) * 1e-6 >= TIMED_TARGET_S
                )
                if enough:
                    break
                # Sized again for every batch: a warm-up's outputs are the runner's word, and once
                # a batch's check has seen the reference's, the poison and the batch follow that
                # (a warm-up that describes a tiny output wins one batch at most).
                per_batch = self.batch_calls(shape)
                n = min(per_batch, target - len(samples))
                calls, wall_us, reported, times, described = self.timed_batch(shape, n, calibration)
                if gpu:
                    outside_us += wall_us - calibration.rtt_us
                    accounted_us += sum(reported) + n * calibration.flush_us
                    per_call = (wall_us - calibration.rtt_us) / n - calibration.flush_us
                else:
                    per_call = wall_us / n  # the interpreter: the judge's clock alone
                # Rule timing from outside: each call counts at its batch's mean by the judge's clock,
                # never at the runner's own per-call split (which a candidate that defers one call's
                # work into the next could skew while the batch's sum stays honest); the events only
                # raise it where they account for more.
                samples.extend([max(per_call, sum(times) / n)] * n)
                # Rule checks on the timed calls: drawn after the batch ran; in the interpreter,
                # whose batches are few and short, every one.
                chosen = (
                    checked_calls(self.rng, n, must=not costly or batch_index == checked_at)
                    if gpu
                    else list(range(n))
                )
                # The shape's first batch is checked with the GPU to itself: its reference's time
                # decides `costly`, and nothing another evaluation runs beside it can stretch it.
                first = gpu and batch_index == 0
                with self.session.gpu(exclusive=first):
                    for i in chosen:
                        where = f"timed call on {shape.describe()}"
                        self.check([calls[i]], [described[i]], trial=-2, where=where)
                        costly = costly or (first and self.reference_s >= COSTLY_REFERENCE_S)
                        checked += 1
                    self.session.drop(calls=calls)
                    if batch_index == proof_at:
                        with contextlib.suppress(_EmptyOutput):
                            self.no_op_proof(shape)
                batch_index += 1
        if batch_index <= proof_at:  # the timing ended (its time target met) before the proof's turn
            with self.session.gpu(exclusive=False), contextlib.suppress(_EmptyOutput):
                self.no_op_proof(shape)
        base = {}
        if baselines:
            arg_sets = []
            with self.session.gpu(exclusive=False):
                for _ in range(self.request.input_sets if gpu else 1):
                    # Baselines compute the output alone (see Problem.without_statistics).
                    inputs = self.problem.without_statistics(
                        self.problem.make_inputs(shape, fresh_seed(), self.device)
                    )
                    arg_sets.append((inputs.args, inputs.kwargs))
            # Their first calls too (torch.compile's build for the shape, seconds of CPU) hold the
            # GPU alone: Inductor times its kernels' configurations in them and keeps the fastest,
            # a choice that work beside it could skew. Each call is timed as the runner times a
            # candidate's, to its end event on the current stream (torch's own code, whose work
            # stays on it): an end event after a device-wide synchronize would add the host's
            # round trip (about 12 us on an H100) to the baselines alone, and at a call of tens of
            # microseconds make any candidate look faster than it is.
            with self.session.gpu(exclusive=True):
                base = {
                    name: benchmark(b, arg_sets, device=self.device, joined_streams=True)
                    for name, b in baselines.items()
                }
            del arg_sets
        stats = sample_stats(samples)
        flops, nbytes = self.problem.flops(shape), self.problem.bytes(shape)
        bound = roofline_seconds(arch, flops, nbytes)
        return ShapeTiming(
            shape=shape.name,
            dtype=shape.dtype,
            bucket=self.problem.bucket(shape),
            candidate=stats,
            baselines=base,
            flops=flops,
            bytes=nbytes,
            achieved_gbps=nbytes / (stats.median_us * 1e-6) / 1e9,
            roofline_fraction=None if bound is None else bound / (stats.median_us * 1e-6),
            outside_us=outside_us / len(samples) if gpu else None,
            accounted=accounted_us / outside_us if gpu and outside_us > 0 else None,
            checked_calls=checked,
            graph="train" if training else "serve",
        )


def _a_time(t) -> bool:
    """A per-call time as the runner must report it: a finite, non-negative number."""
    if isinstance(t, bool) or not isinstance(t, int | float):
        return False
    try:
        return math.isfinite(t) and t >= 0
    except OverflowError:  # an int too large for a float
        return False


@dataclass(frozen=True)
class Calibration:
    """What honest timing leaves between the judge's clock and the runner's events, measured by
    the judge: the channel's round trip and the L2 flush (the runner's own, sandbox.flush)."""

    rtt_us: float
    flush_us: float

    @classmethod
    def measure(cls, runner: RunnerProcess, device: torch.device) -> Calibration:
        rtts = []
        for _ in range(7):
            t0 = time.perf_counter()
            runner.ask({"op": "ping"}, where="ping")
            rtts.append((time.perf_counter() - t0) * 1e6)
        flush = L2Flush(device)
        flush()  # untimed: the first one loads its kernel and meets the buffer's own first writes
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            flush()
        end.record()
        end.synchronize()
        return cls(rtt_us=statistics.median(rtts), flush_us=start.elapsed_time(end) * 1e3 / 10)

    def audit(self, shape: Shape, wall_us: float, times: list[float]) -> list[float]:
        """Rule timing from outside: the per-call times the runner reports, held to the judge's
        clock. They cannot exceed it; where they leave more of it unexplained (less the flushes
        and the round trip) than honest timing does, they are raised in proportion to account
        for it, so that a time can only go down by the kernel being faster; where they account
        for less than half of it (work on a stream the events do not see, a forged timer), or
        leave too little of it for the flushes (calls timed without them), the result is
        suspicious."""
        n, reported = len(times), sum(times)
        work = wall_us - self.rtt_us - n * self.flush_us  # what the calls took by the judge's clock
        if reported > wall_us * (1 + SLACK_FRACTION) + BATCH_SLACK_US:
            raise Verdict(Status.SUSPICIOUS, f"timing {shape.describe()}: the runner reported "
                          f"{reported:.0f} us of calls in {wall_us:.0f} us of the judge's clock")  # fmt: skip
        beside = wall_us - self.rtt_us - reported
        if self.flush_us > 0 and beside + self.rtt_us / 2 < FLUSHES_SEEN * n * self.flush_us:
            # Honest timing flushes the L2 before each call, inside the judge's clock: a batch
            # that leaves no room for the flushes skipped them (a flush patched away in the
            # runner's process), and its calls ran on what the L2 still held. (Half a round trip
            # of slack: this batch's may have been quicker than the calibration's median.)
            raise _Unexplained(
                Status.SUSPICIOUS,
                f"timing {shape.describe()}: the judge's clock holds {beside:.0f} us beside the "
                f"calls' {reported:.0f} us, less than half of their {n} L2 flushes "
                f"({n * self.flush_us:.0f} us): calls timed without their flushes",
            )
        if work - reported <= SLACK_FRACTION * work + n * PER_CALL_SLACK_US + BATCH_SLACK_US:
            return times
        if reported < 0.5 * work:
            raise _Unexplained(
                Status.SUSPICIOUS,
                f"timing {shape.describe()}: the runner's per-call times account for {reported:.0f} us "
                f"of the {work:.0f} us its calls took by the judge's clock: work outside the timed "
                "calls' events",
            )
        factor = work / max(reported, 1e-9)
        return [t * factor for t in times]


def baseline_providers(problem: Problem, names: list[str], device: torch.device) -> dict:
    """The named baselines of `problem` as callables (unknown names: ValueError)."""
    known = {"reference": problem.reference, **problem.baselines}
    out = {}
    for name in names:
        if name == "reference.compile":
            # On a CPU this costs a C++ build per shape and times nothing a GPU cares about.
            if device.type == "cuda":
                out[name] = problem.compile_reference(problem.reference)
        elif name in known:
            out[name] = known[name]
        else:
            raise ValueError(f"unknown baseline {name!r}; known: {sorted(known) + ['reference.compile']}")
    return out


class PhaseClock:
    """Seconds spent in each named phase; starting one ends the one before. The phases partition
    the time from the first start to the last stop: a wait inside a phase (`waited`) is taken out
    of it into a phase of its own."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._name: str | None = None
        self._since = 0.0

    def start(self, name: str) -> None:
        self.stop()
        self._name, self._since = name, time.perf_counter()

    def waited(self, seconds: float, name: str = "lock_wait") -> None:
        """`seconds` of the running phase, just ended, spent waiting: counted as `name` instead."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        if self._name is not None:
            self._since += seconds

    def stop(self) -> dict[str, float]:
        if self._name is not None:
            self.phases[self._name] = self.phases.get(self._name, 0.0) + time.perf_counter() - self._since
            self._name = None
        return dict(self.phases)


def evaluate(request: EvalRequest, deadline_mark: Path | None = None) -> EvalResult:
    """The evaluation `request` asks for; `deadline_mark`: where moves of its deadline are written
    (Deadline)."""
    t0 = time.perf_counter()
    deadline = Deadline(request.timeout_s, deadline_mark)
    clock = PhaseClock()
    clock.start("setup")  # the problem's module imported
    ev = Evaluation(request, clock)
    info: DeviceInfo | None = None
    timings: list[ShapeTiming] = []
    window = None
    runner = None
    status, message, log = Status.OK, "", None
    ev.clock.start("init")
    _check_own_gpu(request)  # outside the try below: its failure, whatever it is, is the judge's own
    try:
        ev.clock.start("start")
        runner = RunnerProcess(request, gpu=ev.device.type == "cuda", deadline=deadline)
        # The judge's own device (its CUDA context, on a GPU) while the runner starts up. Its
        # failure is the judge's, never the candidate's: not one of the errors caught below.
        ev.clock.start("init")
        try:
            info = device_info(ev.device)
        except Exception as exc:  # noqa: BLE001 - re-raised as the judge's own failure
            raise RuntimeError(f"the judge's device: {type(exc).__name__}: {exc}") from exc
        ev.clock.start("start")
        ev.session = Session(runner, ev.problem, ev.device, request.timing_locks, on_wait=ev.clock.waited)
        runner.ask({"op": "ping"}, where="start")
        ev.clock.start("load")
        load = {"op": "load", "source_file": request.source_file, "entry": request.entry,
                "host_float_ops": list(ev.problem.host_float_ops),
                "host_copies_compute": ev.problem.host_copies_compute,
                "gpu_memory_bytes": request.gpu_memory_bytes}  # fmt: skip
        # Rule candidate code under the locks: its import runs code too (a kernel launched at
        # module level, a loop), so it runs under the shared lock, as the checks do, and ends in
        # the runner's synchronize: none of it beside another evaluation's timed batch.
        with ev.session.gpu(exclusive=False):
            runner.ask(load, where="import failed")
        if request.check:
            ev.clock.start("check")
            ev.run_checks()
        if request.timing:
            ev.clock.start("timing")
            start = time.time()
            timings = ev.time_shapes(info)
            window = (start, time.time())
    except Verdict as verdict:
        status, message, log = verdict.status, verdict.message, verdict.log
    except (isolation.IsolationUnavailable, OSError) as exc:
        status, message = Status.RUNTIME_ERROR, f"the runner's sandbox did not start: {exc}"
    except (
        TypeError,
        ValueError,
        KeyError,
        IndexError,
        OverflowError,
        AttributeError,
        RecursionError,
    ) as exc:  # noqa: E501
        # Rule failures: an answer of the runner that got past the checks on its form and still
        # could not be used is the runner's failure, never the judge's crash.
        status, log = Status.RUNTIME_ERROR, traceback.format_exc()
        message = f"the judge could not use the runner's answers ({type(exc).__name__}: {exc})"
    finally:
        ev.clock.start("finish")  # the runner's end (its CUDA context torn down, on a GPU)
        if runner is not None:
            runner.kill()
    if info is None:  # the runner did not start
        ev.clock.start("init")
        info = device_info(ev.device)
    base = {"problem": request.problem, "candidate_id": request.candidate_id, "device": info}
    tail = log if log else (runner.log_tail() if runner is not None else "")
    if message.startswith("import failed") and status == Status.RUNTIME_ERROR:
        status = Status.COMPILE_ERROR
    return EvalResult(
        status=status,
        message=message[:2000],
        checks=ev.checks,
        timings=timings if status == Status.OK else [],
        timing_window=window if status == Status.OK else None,
        wall_s=time.perf_counter() - t0,
        phase_s=ev.clock.stop(),
        gpu_held_s=dict(ev.session.held_s) if ev.session is not None else {},
        log_tail=tail[-LOG_TAIL_CHARS:],
        **base,
    )


def main(argv: list[str]) -> int:
    """python -m sandbox.judge REQUEST RESULT [PARENT_PID]: with PARENT_PID, the judge (and with
    it its runner, which dies with its judge) is killed when that process ends."""
    request_path, result_path = Path(argv[0]), Path(argv[1])
    if len(argv) > 2:
        from sandbox.confine import die_with_parent

        die_with_parent(int(argv[2]))
    request = EvalRequest.model_validate_json(request_path.read_text())
    # One thread for the judge's own torch work (references on small CPU inputs, comparisons):
    # evaluations run side by side, and idle intra-op threads spinning beside another
    # evaluation's interpreted kernels cost it more than they ever gain this one.
    torch.set_num_threads(1)
    if request.cpus:
        # Its place's cores, for this judge and (inherited) its runner: a runner's CPU work stays
        # off the cores of the judges timing on the host's other GPUs.
        os.sched_setaffinity(0, request.cpus)
    if request.gpu is not None:
        # The driver reads it once, when CUDA starts: nothing the judge imports starts CUDA
        # (sandbox.judge_server forks judges only from a process where it has not started).
        assert not torch.cuda.is_initialized()
        os.environ["CUDA_VISIBLE_DEVICES"] = request.gpu
    try:
        result = evaluate(request, deadline_mark=result_path.with_name(DEADLINE_MARK))
    except Exception as exc:  # the judge's own failure: still a result, with its traceback
        import traceback

        result = EvalResult(
            status=Status.RUNTIME_ERROR,
            problem=request.problem,
            candidate_id=request.candidate_id,
            message=f"the judge failed: {type(exc).__name__}: {exc}"[:2000],
            log_tail=traceback.format_exc()[-LOG_TAIL_CHARS:],
        )
    # Written last and atomically: a result file exists only if the judge finished.
    try:
        text = result.model_dump_json()
    except ValueError as exc:  # text the runner sent that no JSON writer takes: still a result
        text = EvalResult(
            status=Status.RUNTIME_ERROR,
            problem=request.problem,
            candidate_id=request.candidate_id,
            message=f"the judge could not write its result: {exc}"[:2000].encode("ascii", "replace").decode(),
        ).model_dump_json()
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
