"""The attention families' public launchers on the library's own kernels: the kit's launchers
(kernels/kit/attention.py) with the forward kernel (kernels/kit/attention_forward.py: in the kit,
since every gradient candidate runs it for the statistics its backward reads) and this package's
backward (backward.py). These are the defaults that `kernels.ops` dispatches to where the
library holds no better kernel.
"""

from __future__ import annotations

from kernels.attention.backward import launch_backward
from kernels.kit import attention as kit
from kernels.kit.attention import (
    ACTIVATIONS,
    SUPPORTED_DTYPES,
    check_gdpa,
    check_jagged_attention,
    check_target_attention,
)
from kernels.kit.attention_forward import launch_forward

# Each looks up this module's launch_forward or launch_backward when called, so that a test can
# count the kernels' launches by replacing them here.


def jagged_attention_forward(*args, **kwargs):
    """kit.jagged_attention_forward on the library's forward kernel."""
    return kit.jagged_attention_forward(*args, launch=launch_forward, **kwargs)


def jagged_attention_backward(*args, **kwargs):
    """kit.jagged_attention_backward on the library's backward kernels."""
    return kit.jagged_attention_backward(*args, launch=launch_backward, **kwargs)


def gdpa_forward(*args, **kwargs):
    """kit.gdpa_forward on the library's forward kernel."""
    return kit.gdpa_forward(*args, launch=launch_forward, **kwargs)


def gdpa_backward(*args, **kwargs):
    """kit.gdpa_backward on the library's backward kernels."""
    return kit.gdpa_backward(*args, launch=launch_backward, **kwargs)


def target_attention_forward(*args, **kwargs):
    """kit.target_attention_forward on the library's forward kernel."""
    return kit.target_attention_forward(*args, launch=launch_forward, **kwargs)


def target_attention_backward(*args, **kwargs):
    """kit.target_attention_backward on the library's backward kernels."""
    return kit.target_attention_backward(*args, launch=launch_backward, **kwargs)


__all__ = [
    "ACTIVATIONS",
    "SUPPORTED_DTYPES",
    "check_gdpa",
    "check_jagged_attention",
    "check_target_attention",
    "gdpa_backward",
    "gdpa_forward",
    "jagged_attention_backward",
    "jagged_attention_forward",
    "launch_backward",
    "launch_forward",
    "target_attention_backward",
    "target_attention_forward",
]
