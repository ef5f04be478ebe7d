"""The library of accepted kernels: source files plus a JSON manifest, and dispatch over them.

Each accepted kernel is a self-contained module (the candidate's source, byte for byte) stored
as `<op>_<source hash>.py` beside `manifest.json`. Dispatch picks, for a call's
(op, GPU architecture, dtype, shape bucket), the fastest accepted kernel, else the library's
hand-written default, else the plain PyTorch reference when Triton cannot run at all.

An op's gradients are ops of dispatch too (`<op>_grad`, registered with `gradient_of=<op>`):
the op's backward resolves them the same way, so a backward kernel that a campaign accepts runs
in training as soon as it is in the library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import importlib.util
import json
import linecache
import os
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels import kit
from search_space.template import source_hash

MANIFEST = "manifest.json"
PACKAGE_LIBRARY = Path(__file__).parent / "library"
ARCH_INTERPRETER = "interpreter"


def interpret_enabled() -> bool:
    """Triton kernels run in the interpreter (on CPU tensors) when TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str | None:
    """The GPU's model (`NVIDIA H200`), which an entry's times are comparable on; None off a GPU.
    Cached per GPU, as device_arch."""
    if device.type != "cuda":
        return None
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def device_arch(device: torch.device) -> str:
    """`sm_90` for an H100/H200; `interpreter` for interpreted Triton; `cpu` otherwise. Cached per
    GPU: every dispatch asks, and the query costs microseconds of host time."""
    if device.type == "cuda":
        return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    return ARCH_INTERPRETER if interpret_enabled() else "cpu"


def kit_refusal(entry: LibraryEntry) -> str | None:
    """Why `entry` cannot run on this checkout's kit, or None (it does not import the kit, or
    was verified with this one)."""
    if entry.kit_hash is None or entry.kit_hash == kit.kit_hash():
        return None
    return (
        f"built against kit {entry.kit_hash}; the kit (kernels/kit) is now {kit.kit_hash()}: "
        "`recforge library verify` verifies it again"
    )


def triton_usable(device: torch.device) -> bool:
    return device.type == "cuda" or interpret_enabled()


GRAPHS = ("serve", "train")  # serving (inference) calls; training steps (a backward will follow)


@dataclass(kw_only=True)
class LibraryEntry:
    """One accepted kernel. `median_us` (geometric mean over its timing shapes) orders entries
    of the same key, or per bucket `bucket_us` (the geometric mean over that bucket's timing
    shapes) where both entries have it, since a kernel may be registered for some buckets only;
    interpreted entries are only ever dispatched on the interpreter."""

    kernel_id: str
    op: str
    entry: str
    source_file: str
    source_hash: str
    arch: str
    dtype: str
    buckets: list[str]
    median_us: float | None
    interpreted: bool
    evidence: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    registered_at: str = ""
    bucket_us: dict[str, float] = field(default_factory=dict)  # bucket -> geometric mean there
    # The buckets where it serves training steps too (a subset of `buckets`, which it serves in
    # serving): a forward whose training form (the statistics its backward reads) was measured
    # slower there than what dispatch ran, or not measured, serves serving only. None: every
    # bucket (entries of ops without statistics, and of manifests that predate the split).
    train_buckets: list[str] | None = None
    # Why `recforge library verify` took it out of dispatch (wrong, or no longer faster than
    # the default kernel on this architecture), or None. Kept in the manifest, with its source.
    demoted: str | None = None
    # The kit (kernels/kit) its source was verified with, where it imports the kit; dispatch
    # refuses it under another kit until `recforge library verify` verifies it again.
    kit_hash: str | None = None

    @property
    def measured_on(self) -> str | None:
        """The GPU model its times were measured on (its evidence's device), or None (not said)."""
        device = self.evidence.get("device")
        return device.get("name") if isinstance(device, dict) else None

    @property
    def graphs(self) -> list[str]:
        """The graphs it serves somewhere: "serve", and "train" where it has training buckets."""
        return ["serve", "train"] if self.train_buckets is None or self.train_buckets else ["serve"]

    def serves(self, graph: str) -> list[str]:
        """The buckets it serves in `graph` ("serve" or "train")."""
        if graph not in GRAPHS:
            raise ValueError(f"unknown graph {graph!r}; graphs: {', '.join(GRAPHS)}")
        return self.buckets if graph == "serve" or self.train_buckets is None else self.train_buckets


class KernelLibrary:
    """A folder of accepted kernels. Writes are atomic (temp file, then rename)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._manifest_file = os.fspath(self.root / MANIFEST)  # stat on every op call: no Path per call
        self._modules: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._entries: tuple[tuple[int, int, int], list[LibraryEntry]] | None = None
        self._refusals: dict[tuple[str, str], str | None] = {}
        self._generation = 0  # bumped whenever best()'s answers may change
        self._checked: tuple[float, int] | None = None  # (monotonic time, _writes) of the last look
        # best()'s choices, for the manifest version they were made on (the _entries tuple).
        self._chosen: tuple[object, dict[tuple[str, ...], LibraryEntry | None]] = (None, {})

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def entries(self) -> list[LibraryEntry]:
        """The manifest's entries, parsed again only when the file changed (dispatch asks on every
        op call: reading and parsing it each time cost a quarter of a millisecond per call). A
        write replaces the file by rename, so its inode, size or mtime tells a new version."""
        try:
            stat = os.stat(self._manifest_file)
        except FileNotFoundError:
            if self._entries is not None:
                self._generation += 1
            self._entries = None
            return []
        version = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        cached = self._entries
        if cached is None or cached[0] != version:
            self._generation += 1
            try:
                raw = json.loads(self.manifest_path.read_text())
                parsed = [LibraryEntry(**e) for e in raw["kernels"]]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"library manifest {self.manifest_path} is unreadable: {exc}") from exc
            cached = self._entries = (version, parsed)
        return list(cached[1])

    def add(
        self,
        *,
        op: str,
        entry: str,
        source: str,
        arch: str,
        dtype: str,
        buckets: list[str],
        median_us: float | None,
        interpreted: bool,
        evidence: dict,
        provenance: dict,
        bucket_us: dict[str, float] | None = None,
        train_buckets: list[str] | None = None,
    ) -> LibraryEntry:
        digest = source_hash(source)
        kernel_id = f"{op}_{digest}"
        new = LibraryEntry(
            kernel_id=kernel_id,
            op=op,
            entry=entry,
            source_file=f"{kernel_id}.py",
            source_hash=digest,
            arch=arch,
            dtype=dtype,
            buckets=sorted(buckets),
            median_us=median_us,
            interpreted=interpreted,
            evidence=evidence,
            provenance=provenance,
            registered_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            bucket_us=dict(bucket_us or {}),
            train_buckets=None if train_buckets is None else sorted(train_buckets),
            kit_hash=kit.kit_hash() if kit.uses_kit(source) else None,
        )
        if new.train_buckets is not None and not set(new.train_buckets) <= set(new.buckets):
            raise ValueError(f"train buckets {new.train_buckets} are not among the buckets {new.buckets}")
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.root / new.source_file, source)
            # Re-registering the same source for the same key replaces the old evidence.
            kept = [
                e
                for e in self.entries()
                if not (e.kernel_id == kernel_id and e.arch == arch and e.dtype == dtype)
            ]
            manifest = {"version": 1, "kernels": [asdict(e) for e in kept + [new]]}
            _atomic_write(self.manifest_path, json.dumps(manifest, indent=2) + "\n")
        return new

    def dispatch_version(self) -> int:
        """A number that changes whenever best()'s answers may: the manifest is looked at again
        after RECHECK_S seconds, or at once after a write through a library of this process."""
        now = time.monotonic()
        checked = self._checked
        if checked is None or now - checked[0] > RECHECK_S or checked[1] != _writes[0]:
            self.entries()
            self._checked = (now, _writes[0])
        return self._generation

    def best(
        self, op: str, arch: str, dtype: str, bucket: str, graph: str = "serve", gpu: str | None = None
    ) -> LibraryEntry | None:
        """The fastest entry for the key among those serving `bucket` in `graph`, chosen once per
        key and manifest version (dispatch asks on every op call). Times are compared only among
        entries measured on one GPU model: those measured on `gpu` (the GPU dispatching, where
        given) first, fastest first, then the rest of the architecture's."""
        entries = self.entries()
        key = (op, arch, dtype, bucket, graph, gpu)
        if self._chosen[0] is not self._entries:
            self._chosen = (self._entries, {})
        chosen = self._chosen[1]
        if key not in chosen:
            chosen[key] = self._choose(entries, *key)
        return chosen[key]

    def _choose(
        self,
        entries: list[LibraryEntry],
        op: str,
        arch: str,
        dtype: str,
        bucket: str,
        graph: str,
        gpu: str | None,
    ) -> LibraryEntry | None:
        candidates = [
            e for e in entries if e.op == op and e.arch == arch and e.dtype == dtype and e.demoted is None
        ]
        matches = [e for e in candidates if bucket in e.serves(graph)]
        if not matches:
            # An entry registered before its op's buckets split into regimes ("d64" before
            # "d64-short" and "d64-long") serves every regime of its old bucket, as it did.
            matches = [e for e in candidates if any(bucket.startswith(f"{b}-") for b in e.serves(graph))]
        if not matches:
            return None
        # Fastest first, on the bucket itself when every match was timed there (entries of older
        # manifests were not); entries without a timing (never on a GPU) rank after timed ones.
        per_bucket = all(bucket in e.bucket_us for e in matches)

        def us(e: LibraryEntry) -> float | None:
            return e.bucket_us[bucket] if per_bucket else e.median_us

        # Down the chain: an entry whose source is not what was verified is passed over. An
        # entry's times rank it only among entries measured on the same GPU model: a kernel that
        # won on an H200 is not faster on an H100 than the H100's own winner for its numbers.
        def rank(e: LibraryEntry) -> tuple:
            return (gpu is not None and e.measured_on != gpu, us(e) is None, us(e) or 0.0, e.registered_at)

        for e in sorted(matches, key=rank):
            if self.refusal(e) is None:
                return e
        return None

    def rekit(self, entry: LibraryEntry) -> LibraryEntry:
        """Record that `entry` was verified again with this kit (dispatch takes it again)."""
        updated = self._update(entry, kit_hash=kit.kit_hash())
        self._refusals.pop((entry.kernel_id, entry.source_hash), None)
        return updated

    def demote(self, entry: LibraryEntry, reason: str) -> LibraryEntry:
        """Take `entry` out of dispatch, saying why (its record and source stay)."""
        return self._update(entry, demoted=reason)

    def retime(
        self, entry: LibraryEntry, median_us: float | None, bucket_us: dict[str, float]
    ) -> LibraryEntry:
        """Record `entry`'s times as measured again (dispatch ranks entries by them)."""
        return self._update(entry, median_us=median_us, bucket_us=bucket_us)

    def _update(self, entry: LibraryEntry, **changes) -> LibraryEntry:
        with self._lock:
            entries = self.entries()
            key = (entry.kernel_id, entry.arch, entry.dtype)
            if not any((e.kernel_id, e.arch, e.dtype) == key for e in entries):
                raise ValueError(
                    f"kernel library {self.root} holds no {entry.kernel_id} for {entry.arch} {entry.dtype}"
                )
            kept = [
                dataclasses.replace(e, **changes) if (e.kernel_id, e.arch, e.dtype) == key else e
                for e in entries
            ]
            manifest = {"version": 1, "kernels": [asdict(e) for e in kept]}
            _atomic_write(self.manifest_path, json.dumps(manifest, indent=2) + "\n")
        return dataclasses.replace(entry, **changes)

    def refusal(self, entry: LibraryEntry) -> str | None:
        """Why dispatch refuses `entry`, or None: its source file must hash to the source_hash
        recorded when it was verified, and a source that imports the kit must have been verified
        with this kit (kit_refusal). Checked once per process and entry (a module, once loaded,
        runs the text that was checked), and reported once as a warning."""
        key = (entry.kernel_id, entry.source_hash)
        if key not in self._refusals:
            try:
                got = source_hash(self._source(entry))
                why = None
                if got != entry.source_hash:
                    why = (
                        f"its source {entry.source_file} hashes to {got}, not {entry.source_hash} as "
                        "verified: edited since"
                    )
                else:
                    why = kit_refusal(entry)
            except (OSError, ValueError) as exc:  # missing, unreadable, not text
                why = (
                    f"its source {entry.source_file} cannot be read ({getattr(exc, 'strerror', None) or exc})"
                )
            self._refusals[key] = why
            if why is not None:
                warnings.warn(f"kernel library {self.root}: {entry.kernel_id} refused: {why}", stacklevel=2)
        return self._refusals[key]

    def refuse(self, entry: LibraryEntry, why: str) -> None:
        """Record that `entry` is not to be dispatched in this process (its load found its source
        changed), and choose again."""
        self._refusals[(entry.kernel_id, entry.source_hash)] = why
        self._chosen = (None, {})
        self._generation += 1
        warnings.warn(f"kernel library {self.root}: {entry.kernel_id} refused: {why}", stacklevel=2)

    def _source(self, entry: LibraryEntry) -> str:
        return (self.root / entry.source_file).read_text()

    def load(self, entry: LibraryEntry) -> Callable[..., torch.Tensor]:
        """The entry function of an accepted kernel's module (imported once per process), from
        source that hashes to the recorded source_hash (ValueError otherwise)."""
        with self._lock:
            module = self._modules.get(entry.kernel_id)
            if module is None:
                path = self.root / entry.source_file
                text = self._source(entry)
                if source_hash(text) != entry.source_hash:
                    raise ValueError(
                        f"kernel library {self.root}: {entry.kernel_id}'s source was edited since it "
                        "was verified"
                    )
                name = f"recforge_library_{entry.kernel_id}"
                spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
                assert spec is not None
                module = importlib.util.module_from_spec(spec)
                module.__file__ = str(path)
                # Triton reads a kernel's source through inspect, which needs the module listed,
                # and through linecache, primed with the verified text (never read again from
                # disk, where it could have changed since).
                sys.modules[name] = module
                linecache.cache[str(path)] = (len(text), None, text.splitlines(True), str(path))
                exec(compile(text, str(path), "exec"), module.__dict__)  # the verified text itself
                self._modules[entry.kernel_id] = module
        return getattr(module, entry.entry)


# Dispatch looks at a manifest on disk at most every RECHECK_S seconds (a stat costs a few
# microseconds, more than the rest of a call's choice); a write through any KernelLibrary of this
# process is seen at once, one by another process within RECHECK_S.
RECHECK_S = 0.05
_writes = [0]  # writes through _atomic_write in this process


def _atomic_write(path: Path, data: str | bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)
    _writes[0] += 1


@dataclass(frozen=True)
class Implementation:
    name: str  # "library:<kernel_id>", "default" or "reference"
    fn: Callable[..., torch.Tensor]
    library: KernelLibrary | None = None  # where a library entry was loaded from


class Dispatcher:
    """Resolves each call to an implementation and remembers what it chose (for tests,
    logs and the model's reports)."""

    def __init__(self) -> None:
        self._library = KernelLibrary(os.environ.get("RECFORGE_LIBRARY", PACKAGE_LIBRARY))
        self._defaults: dict[str, Callable[..., torch.Tensor]] = {}
        self._references: dict[str, Callable[..., torch.Tensor]] = {}
        self._gradient_of: dict[str, str] = {}
        # (library, kernel id) -> its loaded implementation: switching between libraries (a
        # measurement of the model with each) loads each library's kernels once.
        self._loaded: dict[tuple[int, str], Implementation] = {}
        # (op, device type, index, dtype, bucket, graph, interpreted, references only) ->
        # (library, its dispatch version, the choice): what every call pays is this lookup and
        # the bookkeeping.
        self._resolved: dict[tuple, tuple[KernelLibrary, int, Implementation]] = {}
        self.calls: Counter[tuple[str, str]] = Counter()
        self.last: dict[str, str] = {}
        # The ops whose plain PyTorch reference runs, whatever the library holds (references_only);
        # None: every op, those registered later too.
        self._reference_ops: frozenset[str] | None = frozenset()

    @property
    def library(self) -> KernelLibrary:
        return self._library

    @contextlib.contextmanager
    def references_only(self, *ops: str) -> Iterator[None]:
        """Within the block, every call of `ops` and of their gradients (of every op, given none)
        runs its op's plain PyTorch reference: the model on the reference ops, to measure the
        library's kernels against, or on the kernels of the ops a test is about and the
        references of the rest."""
        unknown = sorted(set(ops) - self._references.keys())
        if unknown:
            known = ", ".join(sorted(self._references))
            raise KeyError(f"no op named {', '.join(unknown)}; the ops are {known}")
        before = self._reference_ops
        self._reference_ops = None if not ops or before is None else before | frozenset(ops)
        try:
            yield
        finally:
            self._reference_ops = before

    def _reference(self, op: str) -> bool:
        ops = self._reference_ops
        return ops is None or op in ops or self._gradient_of.get(op) in ops

    @contextlib.contextmanager
    def library_at(self, library: KernelLibrary | str | os.PathLike) -> Iterator[KernelLibrary]:
        """Within the block, dispatch through `library` (or the library at that root); then the
        one before. Pass the same KernelLibrary to switch back and forth without loading its
        kernels again."""
        before = self._library
        self._library = library if isinstance(library, KernelLibrary) else KernelLibrary(library)
        try:
            yield self._library
        finally:
            self._library = before

    def use_library(self, root: str | os.PathLike) -> KernelLibrary:
        self._library = KernelLibrary(root)
        return self._library

    def register_op(
        self, op: str, *, default: Callable, reference: Callable, gradient_of: str | None = None
    ) -> None:
        """`gradient_of`: the op whose backward resolves `op` (its gradients), None for an op that
        model code calls."""
        self._defaults[op] = default
        self._references[op] = reference
        self._resolved.clear()
        if gradient_of is not None:
            self._gradient_of[op] = gradient_of

    def gradient_of(self, op: str) -> str | None:
        """The op whose backward dispatches `op`, or None when `op` is not an op's gradients."""
        return self._gradient_of.get(op)

    def ops(self) -> list[str]:
        """The ops registered for dispatch."""
        return sorted(self._defaults)

    def default(self, op: str) -> Callable[..., torch.Tensor]:
        """The library's hand-written default kernel of `op`."""
        if op not in self._defaults:
            raise ValueError(f"no default kernel for op {op!r}; ops: {sorted(self._defaults)}")
        return self._defaults[op]

    def resolve(
        self, op: str, *, device: torch.device, dtype: str, bucket: str, graph: str = "serve"
    ) -> Implementation:
        """`graph`: "train" for a training step's call (a gradient op's, or a forward that saves
        statistics for its backward), which only entries serving training take."""
        index = device.index
        if device.type == "cuda" and index is None:
            index = torch.cuda.current_device()
        key = (op, device.type, index, dtype, bucket, graph, interpret_enabled(), self._reference(op))
        library = self._library
        hit = self._resolved.get(key)
        if hit is not None and hit[0] is library and hit[1] == library.dispatch_version():
            impl = hit[2]
        else:
            impl = self._choose(op, device=device, dtype=dtype, bucket=bucket, graph=graph)
            self._resolved[key] = (library, library.dispatch_version(), impl)
        self.calls[(op, impl.name)] += 1
        self.last[op] = impl.name
        return impl

    def _choose(
        self, op: str, *, device: torch.device, dtype: str, bucket: str, graph: str
    ) -> Implementation:
        if self._reference(op) or not triton_usable(device):
            impl = Implementation("reference", self._references[op])
        else:
            entry = self._library.best(op, device_arch(device), dtype, bucket, graph, device_name(device))
            if entry is not None:
                key = (id(self._library), entry.kernel_id)
                impl = self._loaded.get(key)
                if impl is None or impl.library is not self._library:
                    try:
                        fn = self._library.load(entry)
                    except ValueError as exc:  # edited after it was checked: down the chain
                        self._library.refuse(entry, str(exc))
                        return self._choose(op, device=device, dtype=dtype, bucket=bucket, graph=graph)
                    impl = self._loaded[key] = Implementation(f"library:{entry.kernel_id}", fn, self._library)
            else:
                impl = Implementation("default", self._defaults[op])
        return impl


DISPATCHER = Dispatcher()
