"""Memory shared between the judge and the runner by file descriptor, with no copy.

A `Region` is one block of memory that the judge allocates and the runner maps: inputs go to the
runner through it, and outputs come back through one the judge hands out for them. It travels as
a file descriptor over the judge's Unix socket (SCM_RIGHTS), which works across the runner's user,
PID and mount namespaces. (Legacy CUDA IPC handles do not: the driver refuses them between PID
namespaces.)

- On a CPU the block is a memfd, sealed against shrinking before it is sent, so that a runner
  cannot truncate it under the judge's mapping (which would be a SIGBUS in the judge).
- On a GPU it is device memory from the CUDA driver's virtual memory API (cuMemCreate with a POSIX
  file-descriptor handle), mapped into each process's address space; torch sees it through
  `__cuda_array_interface__`, so tensors on it are ordinary CUDA tensors to the candidate.

Imports torch and the standard library only: the runner imports this before any candidate code.
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import mmap
import os

import torch

ALIGN = 256  # bytes between tensors packed into one region: TMA and vector loads want 16 or more

DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def contiguous_strides(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class SharedMemoryError(RuntimeError):
    """A region could not be created, imported or viewed as asked."""


class Region:
    """`nbytes` of memory on `device` ("cpu" or "cuda"), mapped in this process at `base`."""

    def __init__(
        self, device: str, nbytes: int, base: int, keep: object, close, read_only: bool = False
    ) -> None:
        self.device, self.nbytes, self.base = device, nbytes, base
        self._keep = keep  # the mmap or the CUDA mapping: alive as long as the region
        self._close = close
        # Mapped so that this process cannot write it (nothing it runs, a kernel included).
        self.read_only = read_only

    def view(self, offset: int, dtype: torch.dtype, shape, strides) -> torch.Tensor:
        """A tensor on this region's memory at byte `offset`; the whole extent it can reach must
        lie inside the region (checked here, so no view of a region reads past its end)."""
        shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
        if len(shape) != len(strides) or any(s < 0 for s in shape) or any(s < 0 for s in strides):
            raise SharedMemoryError(f"bad shape {shape} or strides {strides}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset % itemsize:
            raise SharedMemoryError(f"offset {offset} is not a multiple of {itemsize}")
        extent = (
            0
            if 0 in shape
            else (1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=False))) * itemsize
        )
        if offset + extent > self.nbytes:
            raise SharedMemoryError(f"a view of {extent} bytes at {offset} overruns {self.nbytes} bytes")
        if self.device == "cpu":
            if extent == 0:
                return torch.empty(shape, dtype=dtype)
            flat = torch.frombuffer(self._keep, dtype=torch.uint8, count=self.nbytes)
            return flat[offset : offset + extent].view(dtype).as_strided(shape, strides)
        if extent == 0:
            return torch.empty(shape, dtype=dtype, device="cuda")
        arr = _CudaArray(self, self.base + offset, shape, strides, dtype)
        t = torch.as_tensor(arr, device="cuda")
        return t if arr.carrier is dtype else t.view(dtype)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


class _CudaArray:
    """Just enough of the CUDA array interface for torch.as_tensor to wrap device memory; the
    tensor holds this object, and through it the region, for as long as it lives."""

    _TYPESTR = {
        torch.float64: "<f8",
        torch.float32: "<f4",
        torch.float16: "<f2",
        torch.int64: "<i8",
        torch.int32: "<i4",
        torch.int16: "<i2",
        torch.int8: "|i1",
        torch.uint8: "|u1",
        torch.bool: "|b1",
    }

    def __init__(self, region: Region, ptr: int, shape, strides, dtype: torch.dtype) -> None:
        self.region, self.dtype = region, dtype
        # The array interface knows no bf16 or fp8: wrap their bytes as integers of the same
        # width and reinterpret (torch.Tensor.view(dtype)) afterwards.
        itemsize = torch.empty((), dtype=dtype).element_size()
        carrier = dtype if dtype in self._TYPESTR else {1: torch.uint8, 2: torch.int16}[itemsize]
        self.carrier = carrier
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": self._TYPESTR[carrier],
            "data": (ptr, False),
            "strides": tuple(s * itemsize for s in strides),
            "version": 2,
        }


# ---- CPU: memfd -----------------------------------------------------------------------------

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _cpu_create(nbytes: int) -> tuple[Region, int]:
    fd = os.memfd_create("recforge-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, max(nbytes, 1))
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    return _cpu_map(fd, nbytes), fd


def _cpu_map(fd: int, nbytes: int) -> Region:
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        raise SharedMemoryError("the region's memfd is not sealed against resizing")
    if os.fstat(fd).st_size < max(nbytes, 1):
        raise SharedMemoryError(f"the region's memfd holds fewer than {nbytes} bytes")
    mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
    return Region("cpu", nbytes, base, mm, lambda: None)


# ---- GPU: the CUDA driver's virtual memory management API -----------------------------------

_ALLOCATION_PINNED = 1
_HANDLE_POSIX_FD = 1
_LOCATION_DEVICE = 1
_ACCESS_READ = 1
_ACCESS_READWRITE = 3
_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_libcuda: ctypes.CDLL | None = None


def _cu(name: str, *args) -> None:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    code = getattr(_libcuda, name)(*args)
    if code != 0:
        raise SharedMemoryError(f"{name} failed with CUDA driver error {code}")


def _device_prop() -> _AllocationProp:
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the primary context exists and is current on this thread
    prop = _AllocationProp()
    prop.type = _ALLOCATION_PINNED
    prop.requestedHandleTypes = _HANDLE_POSIX_FD
    prop.location = _Location(_LOCATION_DEVICE, torch.cuda.current_device())
    return prop


def _granularity(prop: _AllocationProp) -> int:
    gran = ctypes.c_size_t()
    _cu("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), _GRANULARITY_MINIMUM)
    return gran.value


def _cuda_map(
    handle: ctypes.c_ulonglong, size: int, prop: _AllocationProp, flags: int = _ACCESS_READWRITE
) -> tuple[int, callable]:
    ptr = ctypes.c_ulonglong()
    _cu("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
        ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))  # fmt: skip
    mapped = False
    try:
        _cu("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
        mapped = True
        access = _AccessDesc(prop.location, flags)
        _cu("cuMemSetAccess", ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1))
    except SharedMemoryError:
        if mapped:
            _cu("cuMemUnmap", ptr, ctypes.c_size_t(size))
        _cu("cuMemAddressFree", ptr, ctypes.c_size_t(size))
        raise

    def close() -> None:
        torch.cuda.synchronize()  # nothing of this process may still use the memory
        _cu("cuMemUnmap", ptr, ctypes.c_size_t(size))
        _cu("cuMemAddressFree", ptr, ctypes.c_size_t(size))
        _cu("cuMemRelease", handle)

    return ptr.value, close


def _padded(nbytes: int, prop: _AllocationProp) -> int:
    gran = _granularity(prop)
    return max(1, math.ceil(max(nbytes, 1) / gran)) * gran


def _cuda_create(nbytes: int) -> tuple[Region, int]:
    prop = _device_prop()
    size = _padded(nbytes, prop)
    handle = ctypes.c_ulonglong()
    _cu("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
    fd = ctypes.c_int(-1)
    try:
        _cu("cuMemExportToShareableHandle", ctypes.byref(fd), handle, _HANDLE_POSIX_FD, ctypes.c_ulonglong(0))
        base, close = _cuda_map(handle, size, prop)
    except SharedMemoryError:
        _cu("cuMemRelease", handle)
        if fd.value >= 0:
            os.close(fd.value)
        raise
    os.set_inheritable(fd.value, False)
    return Region("cuda", nbytes, base, None, close), fd.value


def _cuda_import(fd: int, nbytes: int, writable: bool) -> Region:
    prop = _device_prop()
    size = _padded(nbytes, prop)
    handle = ctypes.c_ulonglong()
    _cu("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd), _HANDLE_POSIX_FD)
    read_only = not writable
    try:
        try:
            base, close = _cuda_map(handle, size, prop, _ACCESS_READWRITE if writable else _ACCESS_READ)
        except SharedMemoryError:
            if writable:
                raise
            # A driver that maps this memory writable only: the caller compares instead.
            base, close = _cuda_map(handle, size, prop)
            read_only = False
    except SharedMemoryError:
        _cu("cuMemRelease", handle)
        raise
    return Region("cuda", nbytes, base, None, close, read_only=read_only)


# ---- public ---------------------------------------------------------------------------------


def create_region(device: str, nbytes: int) -> tuple[Region, int]:
    """A new region and the file descriptor that shares it (the caller sends, then closes it)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return _cuda_create(nbytes) if device == "cuda" else _cpu_create(nbytes)


def import_region(device: str, fd: int, nbytes: int, *, writable: bool = True) -> Region:
    """Map the region that `fd` shares (the fd may be closed afterwards). Not `writable`: on a
    GPU mapped read-only where the driver allows (Region.read_only), so that a kernel's write
    faults; a CPU mapping stays writable (Triton's interpreter writes every argument back after
    a launch, changed or not), and the caller compares what must not change instead."""
    if device not in ("cpu", "cuda"):
        raise SharedMemoryError(f"unknown device {device!r}")
    return _cuda_import(fd, nbytes, writable) if device == "cuda" else _cpu_map(fd, nbytes)
