"""Static screen of candidate source, before anything runs.

Each rule is written beside the check that enforces it. A rejection names the rule and line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

# Rule imports: a candidate is a self-contained kernel module; nothing but the kernel
# languages and math may be imported (no os, sys, ctypes, threading, socket, ...).
ALLOWED_IMPORTS = {"torch", "triton", "triton.language", "math", "__future__"}

# Rule builtins: no file, code-loading or introspection builtins.
FORBIDDEN_CALLS = {
    "open",
    "exec",
    "eval",
    "compile",
    "__import__",
    "globals",
    "locals",
    "vars",
    "getattr",
    "setattr",
    "delattr",
    "breakpoint",
    "input",
    "memoryview",
}

# Rule attributes: no CUDA streams, events or synchronization (the timer must see all work),
# no frames, module tables or dunder plumbing, no escape to torch's C bindings.
FORBIDDEN_ATTRIBUTES = {
    "Stream",
    "Event",
    "synchronize",
    "stream",
    "current_stream",
    "default_stream",
    "set_stream",
    "_C",
    "_dynamo",
    "_inductor",
    "cuda_graph",
    "CUDAGraph",
    "graph",
    "__dict__",
    "__class__",
    "__globals__",
    "__builtins__",
    "__subclasses__",
    "__code__",
    "f_back",
    "f_globals",
    "modules",
    "do_bench",
    "perf_counter",
    "elapsed_time",
    "manual_seed",
    "get_rng_state",
    "set_rng_state",
}


@dataclass(frozen=True)
class Violation:
    rule: str
    line: int
    detail: str

    def __str__(self) -> str:
        return f"line {self.line}: rule '{self.rule}': {self.detail}"


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr in {"jit", "autotune", "heuristics"}


def screen(source: str, entry: str) -> list[Violation]:
    """All violations of the rules in `source`; empty means it may run."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [Violation("syntax", exc.lineno or 0, exc.msg)]
    found: list[Violation] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in ALLOWED_IMPORTS:
                    found.append(Violation("imports", node.lineno, f"import of {alias.name!r}"))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module not in ALLOWED_IMPORTS:
                found.append(Violation("imports", node.lineno, f"import from {module or '.'!r}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in FORBIDDEN_CALLS:
                found.append(Violation("builtins", node.lineno, f"call of {node.func.id}()"))
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
            found.append(Violation("attributes", node.lineno, f"use of .{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in {"__builtins__", "__loader__", "__spec__"}:
            found.append(Violation("attributes", node.lineno, f"use of {node.id}"))
    top = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    # Rule kernel: the op must be computed by a Triton kernel, not by a torch fallback.
    if not any(_is_triton_jit(d) for fn in top.values() for d in fn.decorator_list):
        found.append(Violation("kernel", 1, "no @triton.jit kernel is defined"))
    # Rule entry: the entry point the problem calls must exist at module level.
    if entry not in top:
        found.append(Violation("entry", 1, f"no top-level function {entry!r}"))
    return sorted(found, key=lambda v: v.line)
