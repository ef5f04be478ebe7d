"""The kit: the kernel library's shared Triton helpers and launch utilities, the one package a
candidate may import besides the kernel languages (sandbox.screen allows `from kernels.kit.<module>
import <name>` for the names `exports` gives, and nothing else of the library). A candidate then
holds the kernels it changes and its entry, not a copy of the library.

The kit is part of what a candidate's source means: its content hash (`kit_hash`, over every
module of the kit, so that an edit of any of them re-verifies every entry built on it) is part of
every kit-using candidate's identity and is recorded in each library entry, and dispatch refuses
an entry built against another kit (kernels.registry), with the reason shown by `recforge
library list`.

Modules: `attention`, the attention families' device helpers, checks, host-side layout and
public launchers (which take the kernels' launch function); `attention_forward`, their forward
kernel, which forward candidates start from and gradient candidates run for the statistics
their backward reads; `embeddings`, the numbering of sorted ids that the fused embedding update
builds on, and the embedding kernels' register caps; `tiles`, the tile multiply-accumulate of
the GEMM-shaped kernels (grouped GEMM, Wukong's block), its operand precision picked from the
operands.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
from pathlib import Path

MODULES = ("attention", "attention_forward", "embeddings", "tiles")
# What a candidate may import of a module whose text candidates start from (a candidate binds no
# dunder name, so such a module declares no __all__); the others' is their __all__.
LISTED = {"attention_forward": ("launch_forward",)}
_HERE = Path(__file__).parent


def exports(name: str) -> frozenset[str]:
    """The names a candidate may import from kit module `name` (empty for one outside MODULES)."""
    if name not in MODULES:
        return frozenset()
    if name in LISTED:
        return frozenset(LISTED[name])
    return frozenset(importlib.import_module(f"{__name__}.{name}").__all__)


@functools.lru_cache(maxsize=512)
def uses_kit(source: str) -> bool:
    """Whether a candidate's source imports from the kit (`from kernels.kit.<module> import
    <name>`, the only way the screen lets it in), read from its imports however they are spaced;
    a source that does not parse imports nothing."""
    # One parse at a time, under the lock every parse of candidate source takes (CPython 3.11's
    # parser is not thread-safe). Imported here: the runner, which sees the kit but not the
    # search space, never asks.
    from search_space.template import parse_source

    try:
        tree = parse_source(source)
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kernels":
            return True
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "kernels" for a in node.names):
            return True
    return False


@functools.cache
def kit_hash() -> str:
    """sha256 over the kit's files (names and bytes, in name order), first 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted(_HERE.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
