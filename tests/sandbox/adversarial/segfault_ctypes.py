"""Crashes the worker with a segmentation fault through ctypes."""
# expect: static_rejected | 'ctypes'
# base: yes

import ctypes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    ctypes.string_at(0)
    return weight
