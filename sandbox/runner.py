"""The untrusted side of an evaluation: `python -m sandbox.runner FD` (or `--connect PATH`).

The runner imports the candidate and does what its judge (sandbox.judge) asks over the channel on
descriptor FD: map the regions the judge shares, call the entry on tensors viewing them, time
batches of calls with device events, and copy outputs into a region the judge hands out for them.
It runs as an unprivileged user in its own namespaces (sandbox.isolation), with no route to the
judge's files, and nothing it says is believed: the judge checks every output's bytes itself,
and bounds every time the runner reports by its own clock.

The runner's own checks (an exact torch.Tensor, no memory shared with an input or another output)
only ever fail a candidate, so a runner that lies about them gains nothing.

Imports torch, the standard library and sandbox's shared-memory and channel modules, and each of
those before the candidate's code exists in the process; Triton comes with the candidate.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # Limits and the drop to an unprivileged user come first: unshare(CLONE_NEWUSER) refuses a
    # process with threads, and importing torch starts some.
    from sandbox import confine

    confine.confine(confine.parse_args(sys.argv[1:]))

import contextlib
import importlib.util
import os
import socket
import time
import traceback
from collections.abc import Iterator

import torch

from sandbox import confine, host_ops, interpreter_calls, interpreter_memory, shared, wire
from sandbox.flush import L2Flush
from sandbox.poison import poison

TRACEBACK_CHARS = 4000

# Taken before any candidate code runs: the C functions themselves, which a module attribute
# patched later cannot replace.
_perf_counter = time.perf_counter
_cuda_synchronize = getattr(torch._C, "_cuda_synchronize", None)
_refcount = sys.getrefcount
_storage_use_count = torch._C._storage_Use_Count  # owners of a storage (its tensors, wrappers)


class RunnerError(Exception):
    """A request this runner cannot serve (a protocol error on the judge's side)."""


def _is_compile_error(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"CompilationError", "CompileTimeAssertionFailure", "OutOfResources"})


class HostCompute(Exception):
    """A call that raised after the watch found host compute in it (sandbox.host_ops)."""


def _error(exc: BaseException) -> dict:
    # No prefix saying where: the judge names the step it asked for (judge.RunnerProcess.ask).
    if isinstance(exc, HostCompute):
        cause = exc.__cause__
        return {
            "kind": "host_compute",
            "message": f"{exc} (then the call raised {type(cause).__name__}: {cause})"[:2000],
            "traceback": traceback.format_exc()[-TRACEBACK_CHARS:],
        }
    return {
        "kind": "compile_error" if _is_compile_error(exc) else "runtime_error",
        "message": f"{type(exc).__name__}: {exc}"[:2000],
        "traceback": traceback.format_exc()[-TRACEBACK_CHARS:],
    }


def _kernel_classes() -> list[type]:
    """The classes whose `run` launches a kernel itself (jit and interpreted functions): the
    wrappers around them (autotune, heuristics, their pre-hooks) keep running, so host work done
    there shows in the no-op proof's output."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    found, todo = [], [JITFunction, InterpretedFunction]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@contextlib.contextmanager
def kernels_disabled() -> Iterator[None]:
    """Every Triton kernel launch (jit, interpreted, autotuned) returns without running."""
    patched = [(cls, cls.__dict__["run"]) for cls in _kernel_classes() if "run" in cls.__dict__]
    try:
        for cls, _ in patched:
            cls.run = lambda self, *args, **kwargs: None
        yield
    finally:
        for cls, run in patched:
            cls.run = run


class Runner:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.regions: dict[int, shared.Region] = {}
        self.updated_regions: set[int] = set()  # ids of regions of arguments updated in place
        self.returned_none: set[int] = set()  # calls that returned None (an op's update in place)
        self.outputs: dict[int, list[torch.Tensor]] = {}  # call id -> its output tensors
        self.fn = None
        self._flush: L2Flush | None = None
        # The host-compute watch (sandbox.host_ops): on for the calls of a run that asks for it;
        # what it found, by call id; the torch ops the problem lets host code run on floats.
        self.watch = False
        self.host_compute: dict[int, str] = {}
        self.held: dict[int, str] = {}  # call id -> why its output is not the caller's alone
        self.host_float_ops: frozenset[str] = frozenset()
        self.host_copies_compute = False

    # -- requests ------------------------------------------------------------------------------

    def serve(self) -> None:
        while True:
            try:
                message, fds = wire.receive(self.sock)
            except wire.ChannelClosed:
                return
            op = message.get("op")
            handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
            try:
                if handler is None:
                    raise RunnerError(f"unknown request {op!r}")
                reply = handler(message, fds)
            except RunnerError as exc:
                reply = {"ok": False, "error": {"kind": "protocol", "message": str(exc)}}
            except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error the candidate left behind
                reply = {"ok": False, "error": _error(exc)}
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            if reply is None:  # exit
                return
            # The reply names the request it answers (a timed run's final answer names the "go").
            reply.setdefault("re", message.get("nonce"))
            wire.send(self.sock, reply)

    def op_ping(self, message: dict, fds: list[int]) -> dict:
        return {"ok": True, "device": self.device}

    def op_exit(self, message: dict, fds: list[int]) -> None:
        return None

    def op_load(self, message: dict, fds: list[int]) -> dict:
        self.host_float_ops = frozenset(str(op) for op in message.get("host_float_ops", ()))
        self.host_copies_compute = message.get("host_copies_compute") is True
        host_ops.prepare_triton(_kernel_classes())
        if self.device == "cpu":  # Triton interprets: its kernels' pointers are host addresses
            interpreter_calls.install()  # first: interpreter_memory's launch wrapper stays outermost
            interpreter_memory.install()
        self._cap_device_memory(message.get("gpu_memory_bytes"))
        if self.device == "cuda" and self._flush is None:
            # Made before the candidate's code exists: nothing it patches (torch.ones, say) can
            # shrink the buffer. Touched once here, so no first cudaMalloc of 128 MB falls inside
            # the judge's clock.
            self._flush = L2Flush("cuda")
            _cuda_synchronize()
        try:
            path = message["source_file"]
            # The text the screen read (sandbox.screen, rule text): UTF-8, compiled from the
            # string, whatever the file might declare.
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
            spec = importlib.util.spec_from_file_location("candidate", path)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules["candidate"] = module  # triton's source inspection looks modules up here
            exec(compile(text, path, "exec", dont_inherit=True), module.__dict__)
            fn = getattr(module, message["entry"], None)
            if not callable(fn):
                raise AttributeError(f"the module defines no callable {message['entry']!r}")
            self._sync()  # device work the import launched ends before the answer
        except BaseException as exc:  # noqa: BLE001 - the candidate's own code: anything can come out
            if isinstance(exc, KeyboardInterrupt):
                raise
            with contextlib.suppress(Exception):  # launched before it failed: ended too
                self._sync()
            return {"ok": False, "error": {**_error(exc), "kind": "compile_error"}}
        self.fn = fn
        return {"ok": True}

    def _cap_device_memory(self, nbytes) -> None:
        """Rule resources: the allocator's share of the GPU, set before any candidate code runs
        (the screen admits nothing of torch.cuda, so the candidate cannot raise it)."""
        if nbytes is None or self.device == "cpu":
            return
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise RunnerError(f"gpu_memory_bytes must be a positive integer, not {nbytes!r}")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), 0)

    def op_region(self, message: dict, fds: list[int]) -> dict:
        if len(fds) != 1:
            raise RunnerError("a region comes with exactly one descriptor")
        writable = message.get("writable", True) is not False
        region = shared.import_region(message["device"], fds[0], int(message["nbytes"]), writable=writable)
        self.regions[int(message["id"])] = region
        # The arguments an op updates in place (Problem.updates) lie in a writable region of
        # their own: its kernels write them, so they are not guarded against kernel writes.
        if message.get("updated") is True and writable:
            self.updated_regions.add(int(message["id"]))
        return {"ok": True}

    def op_drop(self, message: dict, fds: list[int]) -> dict:
        for cid in message.get("calls", []):
            self.outputs.pop(int(cid), None)
            self.held.pop(int(cid), None)
            self.returned_none.discard(int(cid))
        if message.get("regions"):
            self._sync()
            for rid in message["regions"]:
                region = self.regions.pop(int(rid), None)
                self.updated_regions.discard(int(rid))
                if region is not None:
                    region.close()
        return {"ok": True}

    def op_run(self, message: dict, fds: list[int]) -> dict:
        """Call the entry once per item of `calls`, each on the tensors it names. With `timed`,
        each call is bracketed by device events after an L2 flush and the batch ends with a
        device-wide synchronize; with `noop`, every Triton launch is a no-op."""
        if self.fn is None:
            raise RunnerError("no candidate loaded")
        calls = [(int(c["id"]), self._arguments(c)) for c in message["calls"]]
        timed, noop = bool(message.get("timed")), bool(message.get("noop"))
        self.watch = bool(message.get("watch"))
        poison_bytes = int(message.get("poison_bytes", 0))
        results: list[dict] = []
        answering = message.get("nonce")  # the request this run's answer replies to
        try:
            if timed:
                # Arguments and events are ready: the judge's clock runs from its "go" to this
                # batch's answer, around the calls and the final synchronize alone.
                poison(self.device, poison_bytes * len(calls))  # as before untimed calls
                self._sync()  # the fill done before the judge's clock, and before it times others
                starts, ends = self._prepare_timing(len(calls))
                wire.send(self.sock, {"ok": True, "ready": True, "re": message.get("nonce")})
                go, extra = wire.receive(self.sock)
                for fd in extra:
                    os.close(fd)
                answering = go.get("nonce")
                if go.get("op") != "go":
                    raise RunnerError(f"expected go, got {go.get('op')!r}")
                return {"ok": True, "times": self._timed(calls, starts, ends), "re": answering}
            else:
                times = [None] * len(calls)
                for cid, (args, kwargs) in calls:
                    poison(self.device, poison_bytes)
                    if noop:
                        with kernels_disabled():
                            try:
                                self._call(cid, args, kwargs)
                            except Exception as exc:  # noqa: BLE001
                                self._sync()  # a CUDA error is an error, not an answer
                                if isinstance(exc, HostCompute):
                                    raise  # what the watch found is said, as in any other call
                                # No output without kernels: a fallback would have given one.
                                results.append({"id": cid, "raised": type(exc).__name__})
                                continue
                    else:
                        self._call(cid, args, kwargs)
                    self._sync()
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            return {"ok": False, "error": _error(exc), "re": answering}
        raised = {r["id"] for r in results}
        for (cid, _), us in zip(calls, times, strict=True):
            if cid in raised:
                continue
            results.append({"id": cid, "us": us, **self._describe(cid)})
        return {"ok": True, "calls": results}

    def op_describe(self, message: dict, fds: list[int]) -> dict:
        """What the calls of a timed batch returned (asked once the judge's clock stopped)."""
        return {"ok": True, "calls": [{"id": int(c), **self._describe(int(c))} for c in message["ids"]]}

    def op_fetch(self, message: dict, fds: list[int]) -> dict:
        """Copy outputs into region `region` at the offsets the judge chose, as contiguous bytes."""
        region = self.regions.get(int(message["region"]))
        if region is None:
            raise RunnerError("fetch into an unknown region")
        for item in message["items"]:
            out = self.outputs.get(int(item["call"]))
            if out is None or not 0 <= int(item["output"]) < len(out):
                raise RunnerError(f"no output {item['output']} of call {item['call']}")
            tensor = out[int(item["output"])]
            target = region.view(
                int(item["offset"]), tensor.dtype, tensor.shape, shared.contiguous_strides(tensor.shape)
            )
            target.copy_(tensor)
        self._sync()
        return {"ok": True}

    # -- helpers -------------------------------------------------------------------------------

    def _arguments(self, call: dict) -> tuple[list, dict]:
        def value(v):
            if "t" in v:
                t = v["t"]
                region = self.regions.get(int(t["region"]))
                if region is None:
                    raise RunnerError("an argument on an unknown region")
                return region.view(int(t["offset"]), shared.DTYPES[t["dtype"]], t["shape"], t["strides"])
            return v["v"]

        return [value(a) for a in call["args"]], {k: value(v) for k, v in call["kwargs"].items()}

    def _call(self, cid: int, args: list, kwargs: dict) -> None:
        """Call the entry; its outputs (or what is wrong with them) kept as call `cid`'s. Unwatched,
        the call is the entry's alone (a timed call's events bracket nothing else)."""
        if self.watch:
            copies = self.host_copies_compute
            inputs = [*args, *kwargs.values()]
            guarded = [
                t
                for t in inputs
                if isinstance(t, torch.Tensor) and not self._read_only(t) and not self._updated(t)
            ]
            with host_ops.watching(
                True, self.host_float_ops, copies_compute=copies, inputs=inputs, guarded=guarded
            ) as watch:
                try:
                    out = self.fn(*args, **kwargs)
                except BaseException as exc:
                    # What the watch found before the call raised (or exited) is said with the
                    # error.
                    if watch.first is not None:
                        raise HostCompute(watch.first) from exc
                    raise
            if watch.first is not None:
                self.host_compute[cid] = watch.first
        else:
            out = self.fn(*args, **kwargs)
        # None: an op that updates its arguments in place (its outputs), nothing to fetch; said
        # apart from an empty tuple, which is no None.
        if out is None:
            self.returned_none.add(cid)
        items = [] if out is None else list(out) if isinstance(out, tuple | list) else [out]
        del out  # from here on, `items` holds the outputs' only references the runner made
        # Only plain tensors: a subclass could compare equal to anything.
        other = next((type(t).__name__ for t in items if type(t) is not torch.Tensor), None)
        if other is not None:
            self.outputs[cid] = f"returned {other}, expected torch.Tensor"
            return
        held = _held_elsewhere(items)
        if held:
            self.held[cid] = held
        self.outputs[cid] = items

    def _updated(self, t: torch.Tensor) -> bool:
        """Whether `t` lies on a region of arguments the call updates in place."""
        ptr = t.data_ptr()
        return t.numel() > 0 and any(_inside(ptr, self.regions[rid]) for rid in self.updated_regions)

    def _read_only(self, t: torch.Tensor) -> bool:
        """Whether `t` lies on a region this process has mapped read-only."""
        ptr = t.data_ptr()
        return t.numel() > 0 and any(r.read_only and _inside(ptr, r) for r in self.regions.values())

    def _describe(self, cid: int) -> dict:
        host = self.host_compute.pop(cid, None)
        found = {"host_compute": host} if host else {}
        out = self.outputs.get(cid)
        if isinstance(out, str):
            self.outputs.pop(cid)
            return {"problem": out, **found}
        problem = self._aliasing(cid, out) or self.held.pop(cid, None)
        return {
            **found,
            "tuple": len(out) != 1 or None,
            "none": cid in self.returned_none or None,
            "outputs": [
                {
                    "dtype": shared.dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "strides": list(t.stride()),
                    "device": t.device.type,
                }
                for t in out
            ],  # fmt: skip
            **({"problem": problem} if problem else {}),
        }

    def _aliasing(self, cid: int, out: list[torch.Tensor]) -> str | None:
        """Outputs are fresh memory: none inside a shared region (an input), none sharing storage
        with another output still held (a buffer the candidate hands out twice)."""
        others = {
            t.untyped_storage().data_ptr() for other, ts in self.outputs.items() if other != cid
            for t in (ts if isinstance(ts, list) else []) if t.numel() > 0
        }  # fmt: skip
        mine: set[int] = set()
        for t in out:
            if t.numel() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            for region in self.regions.values():
                if region.device == self.device and _inside(ptr, region):
                    return "the output shares memory with an input"
            if ptr in others or ptr in mine:
                return "the output shares memory with an earlier output"
            mine.add(ptr)
        return None

    def _sync(self) -> None:
        if self.device == "cuda":
            _cuda_synchronize()

    def _prepare_timing(self, n: int) -> tuple[list, list]:
        """The batch's events, made before the judge's clock starts (the flush was made at load)."""
        if self.device != "cuda":
            return [], []
        if self._flush is None:
            raise RunnerError("timing asked of a runner that loaded no candidate")
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        return starts, ends

    def _timed(self, calls: list[tuple[int, tuple[list, dict]]], starts: list, ends: list) -> list[float]:
        if self.device != "cuda":
            times = []
            for cid, (args, kwargs) in calls:
                t0 = _perf_counter()
                self._call(cid, args, kwargs)
                times.append((_perf_counter() - t0) * 1e6)
            return times
        for i, (cid, (args, kwargs)) in enumerate(calls):
            self._flush()
            starts[i].record()
            self._call(cid, args, kwargs)
            ends[i].record()
        # Device-wide: work on any stream is done before the judge's clock stops.
        _cuda_synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]


def _held_elsewhere(items: list[torch.Tensor]) -> str | None:
    """Outputs are the caller's alone: the candidate keeps no reference to one (a ring of
    buffers it hands out again, overwriting what an earlier caller still holds, however many
    outputs the runner holds at a time) and no other tensor on its memory (a view of a buffer it
    keeps). Where an output's memory is shared with an earlier output or an input, _aliasing
    says so by name."""
    for t in items:
        if not t.numel():  # no memory to overwrite (an empty lse, a call without tokens)
            continue
        # References to t: `items`, this loop's `t` and getrefcount's own argument.
        if _refcount(t) > 3:
            return "the candidate keeps a reference to a tensor it returned; outputs must be fresh"
        # A view keeps its base (the tensor it was cut from) alive: one more owner of the memory,
        # whose references are then this `base`, getrefcount's argument and the view's own.
        base = t._base
        if base is not None and _refcount(base) > 3:
            return "the candidate keeps the tensor its output is a view of; outputs must be fresh"
        owners = 2 if base is None else 3  # t (and its base), and the storage wrapper asked here
        if _storage_use_count(t.untyped_storage()._cdata) > owners:
            return "the output's memory is held by another tensor the candidate keeps; outputs must be fresh"
        del base
    return None


def _inside(ptr: int, region: shared.Region) -> bool:
    return region.base <= ptr < region.base + max(region.nbytes, 1)


def main(argv: list[str]) -> int:
    args = confine.parse_args(argv)
    if args.connect:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(args.connect)
    else:
        sock = socket.socket(fileno=args.fd)
    torch.set_num_threads(1)  # as its judge (sandbox.judge.main): evaluations run side by side
    Runner(sock).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
