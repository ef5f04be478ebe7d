"""Reads and writes past the end of a tensor's storage through tl.atomic_cas, whose compare and
new values Triton's semantic never casts to the pointer's element type (atomic_cas, unlike the
other atomics, loads and stores, takes cmp and val as they come). interpreter_memory checks each
address against the launch's storages with the width of the pointer's element (2 bytes for an
int16 pointer), but the interpreter's C extension compares and swaps the width of `cmp` (8 bytes
for an int64): at the last element of a storage, 6 bytes of whatever the allocator placed after
it are read (a failing compare returns them) and written (a matching one swaps them). Here the
storage is one int16 and both launches run at import: the first leaks the heap bytes past it,
the second writes them back unchanged (any other value would corrupt the allocator's metadata or
a neighbouring object: a heap overflow in the runner, with no bound at all on what is read).
The same width gap holds for tensor_descriptor.scatter (its value is not cast either: an int8
descriptor scattered with int64 values writes 7 bytes past its last element).
Held: interpreter_memory checks each access at the widest of the pointer's element and the values
the C extension moves (a store's value, an atomic's compare and value), so the import's launch is
refused."""
# expect: compile_error | outside every tensor its launch was given
# expect-gpu: compile_error |
# base: yes


@triton.jit
def _cas_wide(p, out, cmp, val):
    tl.store(out, tl.atomic_cas(p, cmp.to(tl.int64), val.to(tl.int64)))


_cell = torch.zeros(1, dtype=torch.int16)  # a 2-byte storage: 6 of the 8 bytes swapped lie past it
_seen = torch.zeros(1, dtype=torch.int64)
_cas_wide[(1,)](_cell, _seen, 1, 0)  # the compare fails (the cell is 0): returns the 8 bytes
_past = _seen.item()
_cas_wide[(1,)](_cell, _seen, _past, _past)  # the compare holds: writes the 8 bytes (unchanged)
print("RT-LENT bytes past a 2-byte storage:", (_past >> 16) & 0xFFFFFFFFFFFF)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
