"""The kernel library: public ops (`kernels.ops`), hand-written Triton kernels, the registry of
accepted kernels and the dispatcher that model code goes through."""

from kernels.registry import DISPATCHER, KernelLibrary, LibraryEntry, device_arch

__all__ = ["DISPATCHER", "KernelLibrary", "LibraryEntry", "device_arch"]
