"""Static screen of candidate source, before anything runs.

Each rule is written beside the check that enforces it. A rejection names the rule and line.
"""

from __future__ import annotations

import ast
import threading
from dataclasses import dataclass

from sandbox.candidate import Candidate
from sandbox.result import EvalResult, Status

# CPython 3.11 keeps the AST constructor's recursion depth in state shared by every thread: a
# parse that another thread's parse interrupts (a finalizer run by the garbage collector hands
# over the GIL) fails with "SystemError: AST constructor recursion depth mismatch". A parallel
# LocalBackend screens its candidates in threads, and campaigns may run side by side: every parse
# of candidate source goes through this lock.
_PARSE_LOCK = threading.Lock()


def parse_source(source: str) -> ast.Module:
    """`ast.parse(source)`, one thread at a time (see _PARSE_LOCK); raises SyntaxError."""
    with _PARSE_LOCK:
        return ast.parse(source)


# Rule imports: a candidate is a self-contained kernel module; nothing but the kernel
# languages (TMA tensor descriptors included) and math may be imported (no os, sys, ctypes,
# threading, socket, ...).
ALLOWED_IMPORTS = {
    "torch",
    "triton",
    "triton.language",
    "triton.tools.tensor_descriptor",
    "math",
    "__future__",
}

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

# Rule torch: no part of torch that loads code or data, spawns processes, talks to other
# hosts, changes global numerics (precision flags would let a kernel compute in lower
# precision than the reference checks), or computes the op outside a Triton kernel.
FORBIDDEN_TORCH = (
    "torch.utils",
    "torch.hub",
    "torch.multiprocessing",
    "torch.distributed",
    "torch.ops",
    "torch.library",
    "torch.backends",
    "torch.load",
    "torch.save",
    "torch.from_file",
    "torch.compile",
    "torch.jit",
    "torch.cuda",
    "torch.random",
    "torch.autograd",
    "torch.func",
    "torch.fx",
    "torch.export",
    "torch.set_",
    "torch.use_deterministic_algorithms",
    "torch.manual_seed",
    "torch.seed",
    "torch.initial_seed",
)

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


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """`torch.cuda.synchronize` for that expression, with import aliases resolved."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> module path, for `import torch as T` and `from torch import nn`."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def screen(source: str, entry: str, forbidden_ops: tuple[str, ...] = ()) -> list[Violation]:
    """All violations of the rules in `source`; empty means it may run.

    `forbidden_ops` are the torch functions that compute the problem's op (its fallback), by
    attribute name: a candidate must do that work in a Triton kernel."""
    try:
        tree = parse_source(source)
    except SyntaxError as exc:
        return [Violation("syntax", exc.lineno or 0, exc.msg)]
    aliases = _aliases(tree)
    found: list[Violation] = []
    reported_chain: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in ALLOWED_IMPORTS:
                    found.append(Violation("imports", node.lineno, f"import of {alias.name!r}"))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module not in ALLOWED_IMPORTS:
                found.append(Violation("imports", node.lineno, f"import from {module or '.'!r}"))
            else:
                for a in node.names:
                    full = f"{module}.{a.name}"
                    if any(full.startswith(p) for p in FORBIDDEN_TORCH) or a.name in forbidden_ops:
                        found.append(Violation("torch", node.lineno, f"import of {full}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in FORBIDDEN_CALLS:
                found.append(Violation("builtins", node.lineno, f"call of {node.func.id}()"))
        elif isinstance(node, ast.Attribute) and id(node) not in reported_chain:
            name = _dotted(node, aliases)
            if node.attr in FORBIDDEN_ATTRIBUTES or (node.attr.startswith("__") and node.attr.endswith("__")):
                found.append(Violation("attributes", node.lineno, f"use of .{node.attr}"))
            elif name and any(
                name == p or name.startswith(p if p.endswith("_") else p + ".") for p in FORBIDDEN_TORCH
            ):
                found.append(Violation("torch", node.lineno, f"use of {name}"))
            elif node.attr in forbidden_ops and not (name or "").startswith("triton.language."):
                # Rule fallback: the op itself computed by torch instead of a Triton kernel
                # (triton.language's functions of the same name run inside one).
                found.append(
                    Violation("fallback", node.lineno, f"use of .{node.attr}, which computes the op")
                )
            else:
                continue
            # One violation per chain: `torch.cuda.synchronize` is not also `torch.cuda`.
            inner = node.value
            while isinstance(inner, ast.Attribute):
                reported_chain.add(id(inner))
                inner = inner.value
        elif isinstance(node, ast.BinOp | ast.AugAssign) and isinstance(node.op, ast.MatMult):
            # `a @ b` is torch.matmul by another name (inside a kernel, tl.dot is the product).
            if "matmul" in forbidden_ops:
                found.append(Violation("fallback", node.lineno, "use of the @ operator, a torch matmul"))
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


def screen_candidate(candidate: Candidate) -> EvalResult | None:
    """The screen as every backend applies it before anything runs: the problem's own rules
    included. A static_rejected result naming each violation, or None if the candidate may run."""
    from search_space import get_problem

    try:
        forbidden = get_problem(candidate.problem).forbidden_ops
    except ValueError as exc:
        violations_text = str(exc)
    else:
        violations = screen(candidate.source, candidate.entry, forbidden)
        if not violations:
            return None
        violations_text = "; ".join(str(v) for v in violations)
    return EvalResult(
        status=Status.STATIC_REJECTED,
        problem=candidate.problem,
        candidate_id=candidate.id,
        message=violations_text,
    )
