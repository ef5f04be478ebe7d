"""Static screen of candidate source, before anything runs: an allowlist.

A candidate may import the kernel languages and math, and name only what is listed here: the
public Triton language, a handful of torch and triton host functions, a list of tensor metadata
and layout attributes. Anything not listed is rejected, so a path around the rules (a forbidden
module reached through an allowed one, an alias, a string turned into an attribute, a frame) is
closed by construction rather than by naming it. Each rule is written beside the check that
enforces it; a rejection names the rule and the line.

Names are resolved per module, not per scope: an import alias names its module everywhere, and
a name counts as defined if anything in the module binds it. Where that reading is wrong it
rejects more, never less (a builtin's name, for one, may not be bound at all, so that a local
`open` in one function cannot make `open` look defined in another).
"""

from __future__ import annotations
import __future__

import ast
import builtins
import functools
import importlib
import inspect
import io
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass

from sandbox.candidate import Candidate
from sandbox.interpreter_memory import REWRITE_NAMES
from sandbox.result import EvalResult, Status
from search_space.template import parse_source

# --- what a candidate may name -------------------------------------------------------------

# Rule imports: a candidate is a self-contained kernel module; `import X` only for the kernel
# languages (TMA tensor descriptors included) and math. `from X import name` for any name the
# rule modules allows (`from triton import cdiv`, `from triton.language.extra import libdevice`).
ALLOWED_IMPORTS = frozenset(
    {"torch", "triton", "triton.language", "triton.tools.tensor_descriptor", "math", "__future__"}
)

# Rule modules: every public name of the Triton language (compiled by Triton, or in the
# interpreter run on the kernel's own tiles), of its math and libdevice modules, and of Python's
# math; submodules excepted (triton.language.core, .extra, .random ... are not the language).
OPEN_MODULES = (
    "triton.language",
    "triton.language.math",
    "triton.language.extra.libdevice",
    "triton.language.extra.cuda.libdevice",
    "math",
)

# Rule modules: of triton, what a launch needs.
ALLOWED_TRITON = frozenset(
    {
        "triton.jit",
        "triton.cdiv",
        "triton.next_power_of_2",
        "triton.Config",
        "triton.autotune",
        "triton.heuristics",
        # TMA descriptors of host tensors (the attention kernels' key and value loads) and their
        # documented constructor.
        "triton.tools.tensor_descriptor.TensorDescriptor",
        "triton.tools.tensor_descriptor.TensorDescriptor.from_tensor",
    }
)

# Rule kit: the kernel library's shared helpers and launch utilities (kernels/kit): from each
# module the names it exports (kernels.kit.exports), imported by name (`from kernels.kit.attention
# import _dot`), and only so: never the kit or one of its modules as a value, through which its
# other attributes (its own imports) would be reachable.
KIT_PACKAGE = "kernels.kit"

TORCH_DTYPES = frozenset(
    "torch." + name
    for name in (
        "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64", "bool",
        "float", "half", "double", "int", "long", "short",
    )
)  # fmt: skip

# Rule modules: of torch, dtypes, the types that annotate and check arguments, and allocation.
# No factory computes from its inputs' values (torch.tensor, which copies host data in, is
# left out: a problem that needs it declares it). Nothing else: not torch.cuda (streams, events,
# synchronization, the timer's view of the GPU), torch.ops, torch.library, torch.backends
# (precision flags), torch.nn, torch.utils, torch._C, torch.os ...
ALLOWED_TORCH = TORCH_DTYPES | frozenset(
    "torch." + name
    for name in (
        "Tensor", "dtype", "device", "Size",
        "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
        "full", "full_like", "arange",
    )
)  # fmt: skip

# Rule attributes: what host code may read of a value that is not a module (a tensor, a device,
# a dtype, a list, a dict, a string, a triton object): metadata, layout, allocation, casts and
# copies, never a computation, so that the op's torch fallbacks are not reachable as methods.
VALUE_ATTRIBUTES = frozenset(
    {
        # tensor and dtype metadata; a device's type and index
        "shape", "dtype", "device", "ndim", "size", "stride", "numel", "dim", "element_size",
        "itemsize", "nbytes", "is_contiguous", "is_cuda", "is_floating_point", "data_ptr",
        "storage_offset", "type", "index",
        # layout: views, and copies into another layout
        "contiguous", "view", "reshape", "flatten", "unsqueeze", "squeeze", "transpose", "permute",
        "t", "T", "expand", "narrow", "select", "split", "chunk", "unbind", "clone",
        # allocation, casts, filling, host copies
        "new_empty", "new_zeros", "new_ones", "new_full", "to", "float", "half", "bfloat16", "int",
        "long", "fill_", "zero_", "copy_", "item", "tolist",
        # plain Python containers, strings and ints (no str.format: its fields read attributes
        # by name)
        "append", "extend", "insert", "pop", "items", "keys", "values", "get", "setdefault",
        "update", "copy", "join", "lower", "upper", "strip", "startswith", "endswith",
        "bit_length",
        # a triton GPUTarget's architecture (the capability check above)
        "arch",
    }
)  # fmt: skip

# Rule builtins: only these builtins; none that load code, touch files, look attributes up by
# string or introspect (getattr, vars, globals, eval, open, type, object, super, ...).
ALLOWED_BUILTINS = frozenset(
    {
        "len", "range", "min", "max", "abs", "int", "float", "bool", "str", "tuple", "list",
        "dict", "set", "frozenset", "enumerate", "zip", "isinstance", "sum", "any", "all",
        "sorted", "reversed", "round", "divmod", "pow", "print", "map", "filter", "iter", "next",
        "slice", "id", "hash", "repr", "None", "True", "False", "Ellipsis", "NotImplemented",
        "Exception", "ValueError", "TypeError", "RuntimeError", "NotImplementedError",
        "AssertionError", "KeyError", "IndexError", "LookupError", "ArithmeticError",
        "ZeroDivisionError", "OverflowError", "StopIteration",
    }
)  # fmt: skip
# `object` in an annotation (`-> tuple[bool, object]`) is never called or read: allowed there.
ANNOTATION_BUILTINS = frozenset({"object"})

# Rule asm: inline PTX only where the problem allows it, or one of these instructions, written
# as literals: pure arithmetic on registers. (asm, constraints) as tl.inline_asm_elementwise
# takes them.
VETTED_ASM = frozenset(
    {
        # tanh in one MUFU instruction: the attention kernels' fast silu (kernels/kit/attention.py).
        ("tanh.approx.f32 $0, $1;", "=f,f"),
    }
)


@functools.cache
def kit_modules() -> tuple[str, ...]:
    from kernels import kit

    return tuple(f"{KIT_PACKAGE}.{name}" for name in kit.MODULES)


@functools.cache
def kit_exports(module: str) -> frozenset[str]:
    """What a candidate may import from kit module `module` (kernels.kit.exports)."""
    from kernels import kit

    package, _, name = module.rpartition(".")
    return kit.exports(name) if package == KIT_PACKAGE else frozenset()


def _public_names(module: str) -> frozenset[str]:
    """The public names of an open module, as this process's Triton has them, submodules out."""
    mod = importlib.import_module(module)
    return frozenset(n for n in dir(mod) if not n.startswith("_") and not inspect.ismodule(getattr(mod, n)))


@functools.cache
def kernel_attributes() -> frozenset[str]:
    """Rule attributes, inside a @triton.jit function: also the public members of the language's
    own types (tensor methods such as x.to or x.sum, dtype and pointer properties such as
    ptr.dtype.element_ty, descriptor loads): Triton compiles them, or in the interpreter runs
    them on the kernel's tiles."""
    import triton.language as tl

    types: list[object] = [tl.tensor, tl.tensor_descriptor, tl.float32, tl.constexpr(1)]
    types += [tl.pointer_type(tl.float32), tl.block_type(tl.float32, [16])]
    return frozenset(n for t in types for n in dir(t) if not n.startswith("_"))


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _prefixes(path: str) -> Iterator[str]:
    parts = path.split(".")
    for k in range(1, len(parts)):
        yield ".".join(parts[:k])


@dataclass(frozen=True)
class Violation:
    rule: str
    line: int
    detail: str

    def __str__(self) -> str:
        return f"line {self.line}: rule '{self.rule}': {self.detail}"


class _Screen:
    """One candidate's screen: what the module binds and imports, then every node against the
    rules."""

    def __init__(
        self,
        tree: ast.Module,
        forbidden_ops: tuple[str, ...],
        allowed_extras: frozenset[str],
        allow_inline_asm: bool,
    ) -> None:
        self.tree = tree
        self.forbidden = frozenset(forbidden_ops)
        self.allow_asm = allow_inline_asm
        # A problem's extras: dotted names (torch.cumsum) join the modules rule, bare ones
        # (cumsum, for x.cumsum()) the attributes rule.
        self.extra_names = frozenset(e for e in allowed_extras if "." in e)
        self.extra_attributes = frozenset(e for e in allowed_extras if "." not in e)
        self.namespaces = {p for n in ALLOWED_TORCH | ALLOWED_TRITON | self.extra_names for p in _prefixes(n)}
        self.namespaces |= {m for m in OPEN_MODULES} | {p for m in OPEN_MODULES for p in _prefixes(m)}
        self.namespaces |= set(kit_modules()) | {p for m in kit_modules() for p in _prefixes(m)}
        self.found: list[Violation] = []
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.aliases: dict[str, str] = {}  # import alias -> dotted name
        self.bad_aliases: set[str] = set()  # aliases of imports already rejected
        self.bound: set[str] = set()
        self.declared: set[str] = set()  # names a global or nonlocal statement declares
        self.annotations: set[ast.AST] = set()
        self.decorators: set[ast.AST] = set()
        self.kernel_nodes: set[ast.AST] = set()

    def flag(self, rule: str, node: ast.AST, detail: str) -> None:
        self.found.append(Violation(rule, getattr(node, "lineno", 1), detail))

    # --- resolution ---------------------------------------------------------------------------

    def dotted(self, node: ast.expr) -> str | None:
        """`triton.language.load` for `tl.load`, with import aliases resolved; None if the chain
        does not start at an import."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.aliases:
            return None
        return ".".join([self.aliases[node.id], *reversed(parts)])

    def allowed_name(self, path: str) -> bool:
        module, _, name = path.rpartition(".")
        if module in OPEN_MODULES:
            return name in _public_names(module)
        if module.startswith(KIT_PACKAGE + "."):
            return name in kit_exports(module)
        return path in ALLOWED_TORCH or path in ALLOWED_TRITON or path in self.extra_names

    def is_function(self, path: str) -> bool:
        """Whether an allowed name is a function or class (to call), not a value (a dtype, a
        constant). Looked up in this process for the open modules and torch; triton's listed
        names are all functions (driver.active is not touched: looking it up starts a driver)."""
        if path in TORCH_DTYPES:
            return False
        root, *attrs = path.split(".")
        module, _, name = path.rpartition(".")
        try:
            if module in OPEN_MODULES:
                return callable(getattr(importlib.import_module(module), name))
            if root == "torch":
                obj = importlib.import_module(root)
                for attr in attrs:
                    obj = getattr(obj, attr)
                return callable(obj)
        except (ImportError, AttributeError):
            pass
        return True  # unknown: a function, the stricter reading

    # --- the module's bindings ----------------------------------------------------------------

    def collect(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                self.check_import(node)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                args = node.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                    if arg is not None and arg.annotation is not None:
                        self.annotations.update(ast.walk(arg.annotation))
                if not isinstance(node, ast.Lambda):
                    if node.returns is not None:
                        self.annotations.update(ast.walk(node.returns))
                    self.decorators.update(node.decorator_list)
            elif isinstance(node, ast.AnnAssign):
                self.annotations.update(ast.walk(node.annotation))
            elif isinstance(node, ast.Global | ast.Nonlocal):
                self.declared.update(node.names)
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef) and self.is_kernel(node):
                # The body alone: decorators (heuristics, configs' pre-hooks) and defaults run on
                # the host at every launch, so the language's attribute names are not theirs.
                for statement in node.body:
                    self.kernel_nodes.update(ast.walk(statement))
        for name, node in self.bindings():
            # Rule dunders: no `__x__` name is bound (a module-level __getattr__ runs on every
            # attribute lookup of the module, __builtins__ replaces the builtins).
            if _is_dunder(name):
                self.flag("dunders", node, f"binds {name}")
            # Rule builtins: the name of a builtin that is not allowed is never bound (names
            # resolve per module: a local `open` would make `open` look defined everywhere).
            elif hasattr(builtins, name) and name not in ALLOWED_BUILTINS:
                self.flag("builtins", node, f"binds {name}, the name of a builtin")
            # Rule aliases: an import alias is bound by that import only, so that it names its
            # module wherever it appears (`def f(tl): tl.load` would pass a tensor's load off
            # as the language's).
            elif name in self.aliases:
                self.flag("aliases", node, f"{name} names {self.aliases[name]} and is bound again")
            # Rule names: the interpreter's rewrite of a kernel calls these names of the kernel's
            # module (sandbox.interpreter_memory.REWRITE_NAMES); the module never binds them.
            elif name in REWRITE_NAMES:
                self.flag("names", node, f"binds {name}, a name Triton's interpreter writes into kernels")
            self.bound.add(name)

    def bindings(self) -> Iterator[tuple[str, ast.AST]]:
        """Every name the module binds other than by import, with where."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                yield node.id, node
            elif isinstance(node, ast.arg):
                yield node.arg, node
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.ExceptHandler):
                if node.name:  # `except E:` binds nothing
                    yield node.name, node
            elif isinstance(node, ast.Global | ast.Nonlocal):
                for name in node.names:
                    yield name, node

    def check_import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            if isinstance(node, ast.Import):
                local = alias.asname or alias.name.split(".")[0]
                target = alias.name if alias.asname else local
                # Rule imports: `import X` for the allowed modules only.
                ok = alias.name in ALLOWED_IMPORTS
                detail = f"import of {alias.name!r}"
            else:
                module = node.module or ""
                local, target = alias.asname or alias.name, f"{module}.{alias.name}"
                if module == "__future__":
                    ok = alias.name in __future__.all_feature_names
                else:
                    # Rule imports: `from X import name` for a name the modules rule allows,
                    # never relative, never `*`.
                    ok = not node.level and alias.name != "*"
                    ok = ok and (self.allowed_name(target) or target in self.namespaces)
                    # Rule kit: of the library, names a kit module exports, never a module.
                    if target.split(".")[0] == KIT_PACKAGE.split(".")[0]:
                        ok = ok and self.allowed_name(target)
                detail = f"import from {'.' * node.level + module!r} of {alias.name!r}"
            if not ok:
                self.flag("imports", node, detail)
                # `import triton.testing` binds triton, whose chains are still checked.
                if target not in ALLOWED_IMPORTS:
                    self.bad_aliases.add(local)
            elif _is_dunder(local) or (hasattr(builtins, local) and local not in ALLOWED_BUILTINS):
                self.flag("imports", node, f"import as {local}, a builtin's or dunder name")
            # Rule names: an alias counts as bound everywhere, so never one of the names the
            # interpreter's rewrite writes into a module (bound by an import that never runs).
            elif local in REWRITE_NAMES:
                self.flag(
                    "names", node, f"import as {local}, a name Triton's interpreter writes into kernels"
                )
            # Rule aliases: one name, one module (`import torch as tl` in one function would
            # otherwise make tl.load torch.load there).
            elif self.aliases.get(local, target) != target:
                self.flag("aliases", node, f"{local} names both {self.aliases[local]} and {target}")
            self.aliases.setdefault(local, target)

    def defined(self, name: str) -> bool:
        return name in self.bound or name in ALLOWED_BUILTINS or name in ANNOTATION_BUILTINS

    def is_kernel(self, fn: ast.FunctionDef) -> bool:
        for decorator in fn.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            if self.dotted(target) == "triton.jit":
                return True
        return False

    # --- the rules, node by node ----------------------------------------------------------------

    def run(self, entry: str) -> list[Violation]:
        self.collect()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name):
                self.check_name(node)
            if isinstance(node, ast.Name | ast.Attribute):
                parent = self.parents.get(node)
                if not (isinstance(parent, ast.Attribute) and parent.value is node):
                    self.check_chain(node)  # once per chain, at its outermost attribute
            elif isinstance(node, ast.ClassDef):
                # Rule statements: no classes. A class's dunder methods run implicitly (torch
                # calls __torch_function__, the collector __del__, comparisons __eq__), and its
                # attribute names would join the attributes rule's for every value.
                self.flag("statements", node, f"class definition {node.name}")
            elif isinstance(node, ast.Match):
                # Rule statements: no match statements (class patterns read attributes by name).
                self.flag("statements", node, "match statement")
            elif isinstance(node, ast.With | ast.AsyncWith):
                # Rule statements: no with statements: the one context manager within reach,
                # torch.device, sets torch's default device for the whole process while entered.
                self.flag("statements", node, "with statement")
            elif isinstance(node, ast.Try | ast.TryStar):
                # Rule statements: no exception handling: a candidate that catches errors can
                # probe its surroundings (the depth of the stack under the host-compute watch,
                # which launches fail) and act on what it finds; a kernel has nothing to catch.
                self.flag("statements", node, "try statement")
            elif isinstance(node, ast.Delete):
                self.check_delete(node)
            elif isinstance(node, ast.Call):
                self.check_call(node)
            elif isinstance(node, ast.BinOp | ast.AugAssign) and isinstance(node.op, ast.MatMult):
                self.check_matmul(node)
        top = {n.name: n for n in self.tree.body if isinstance(n, ast.FunctionDef)}
        # Rule kernel: the op must be computed by a Triton kernel, not by a torch fallback.
        if not any(self.is_kernel(fn) for fn in top.values()):
            self.flag("kernel", self.tree, "no @triton.jit kernel is defined")
        # Rule entry: the entry point the problem calls must exist at module level.
        if entry not in top:
            self.flag("entry", self.tree, f"no top-level function {entry!r}")
        return sorted(self.found, key=lambda v: v.line)

    # Rule hooks: the autotuner's and a config's hooks run the candidate's code inside Triton's
    # benchmarking, which the host-compute watch leaves alone (sandbox.host_ops).
    HOOK_KEYWORDS = {
        "triton.autotune": {
            "pre_hook",
            "post_hook",
            "prune_configs_by",
            "do_bench",
            "perf_model",
            "early_config_prune",
        },
        "triton.Config": {"pre_hook"},
    }

    def check_delete(self, node: ast.Delete) -> None:
        # Rule names: no module-level name is deleted. The rule takes a name that a module-level
        # statement binds as bound everywhere; deleted, the name is missing from the module's
        # globals, where Triton's interpreter may put a name of its own (interpreter_memory.py).
        for target in node.targets:
            for name in (n for n in ast.walk(target) if isinstance(n, ast.Name)):
                if self.scope_of(name) is self.tree or name.id in self.declared:
                    self.flag("names", node, f"deletes {name.id}, a module-level name")

    def check_call(self, node: ast.Call) -> None:
        path = self.dotted(node.func)
        for keyword in node.keywords:
            if keyword.arg in self.HOOK_KEYWORDS.get(path or "", ()):
                self.flag("hooks", node, f"{path}({keyword.arg}=...): no hooks in Triton's benchmarking")
            elif keyword.arg is None and path in self.HOOK_KEYWORDS:
                self.flag("hooks", node, f"{path}(**...): keywords must be named")
        # Rule fallback: torch.Tensor names the type (annotations, isinstance); called, it makes
        # a tensor of host values the candidate computed in Python.
        if path == "torch.Tensor":
            self.flag("fallback", node, "torch.Tensor(...) builds a tensor from host values")

    def check_matmul(self, node: ast.BinOp | ast.AugAssign) -> None:
        # Rule fallback: `a @ b` is torch.matmul by another name (in a kernel, tl.dot).
        if "matmul" in self.forbidden:
            self.flag("fallback", node, "use of the @ operator, a torch matmul")

    # Rule names, by scope: a name read must be bound in its own scope or an enclosing one (a
    # parameter of one function defines nothing elsewhere: the interpreter's Triton writes names
    # such as `np` into the module's globals at run time, which a name bound only as some
    # parameter would then reach).
    _SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
               ast.GeneratorExp)  # fmt: skip

    def scope_of(self, node: ast.AST) -> ast.AST:
        """The scope a node is evaluated in: decorators, defaults and annotations of a function
        belong to the scope around it."""
        child, parent = node, self.parents.get(node)
        while parent is not None and not isinstance(parent, ast.Module):
            if isinstance(parent, self._SCOPES):
                outside = []
                if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
                    outside = [*parent.decorator_list, parent.returns]
                if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    outside += [*parent.args.defaults, *parent.args.kw_defaults]
                if isinstance(parent, ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
                    outside.append(parent.generators[0].iter)  # the first iterable is outside
                if not any(child is o for o in outside if o is not None):
                    return parent
            child, parent = parent, self.parents.get(parent)
        return self.tree

    def module_bindings(self) -> set[str]:
        """Rule names, at module level: the names that statements of the module's body bind
        unconditionally (imports, assignments, function definitions). A name bound only in a
        branch or a loop may never be bound at run time, and then reads a global that
        something else put there (the interpreter's Triton copies its own module's globals,
        a setattr by string among them, into the candidate's)."""
        names: set[str] = set()
        for node in self.tree.body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name.split(".")[0]) for a in node.names)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        return names

    def scope_bindings(self, scope: ast.AST) -> set[str]:
        cache = self.__dict__.setdefault("_scope_cache", {})
        if scope is self.tree:
            if id(scope) not in cache:
                cache[id(scope)] = self.module_bindings()
            return cache[id(scope)]
        if id(scope) not in cache:
            names: set[str] = set()
            for n in ast.walk(scope):
                if n is scope:
                    continue
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store | ast.Del):
                    where = self.scope_of(n)
                elif isinstance(n, ast.arg):
                    where = self.parents.get(self.parents.get(n))  # arg -> arguments -> function
                elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    where = self.scope_of(n)
                elif isinstance(n, ast.Import | ast.ImportFrom):
                    where = self.scope_of(n)
                    names.update((a.asname or a.name.split(".")[0]) for a in n.names if where is scope)
                    continue
                elif isinstance(n, ast.ExceptHandler) and n.name:
                    where = self.scope_of(n)
                    if where is scope:
                        names.add(n.name)
                    continue
                else:
                    continue
                if where is scope:
                    name = n.arg if isinstance(n, ast.arg) else n.id if isinstance(n, ast.Name) else n.name
                    names.add(name)
            cache[id(scope)] = names
        return cache[id(scope)]

    def bound_in_scope(self, node: ast.AST, name: str) -> bool:
        scope = self.scope_of(node)
        while True:
            if name in self.scope_bindings(scope):
                return True
            if scope is self.tree:
                return False
            scope = self.scope_of(scope)

    def check_name(self, node: ast.Name) -> None:
        name = node.id
        if name in self.aliases or not isinstance(node.ctx, ast.Load):
            return  # imports and bindings: checked where they bind
        # Rule dunders: no `__x__` name (__builtins__, __loader__, __spec__, __file__ ...).
        if _is_dunder(name):
            self.flag("dunders", node, f"use of {name}")
        elif self.bound_in_scope(node, name) or (name in ANNOTATION_BUILTINS and node in self.annotations):
            return
        # Rule builtins: only the allowed builtins.
        elif hasattr(builtins, name) and name not in ALLOWED_BUILTINS:
            called = isinstance(self.parents.get(node), ast.Call) and self.parents[node].func is node
            self.flag("builtins", node, f"use of {name}()" if called else f"use of {name}")
        # Rule names: any other name is defined in the module.
        elif name not in ALLOWED_BUILTINS:
            self.flag("names", node, f"{name} is not defined in the module")

    def check_chain(self, top: ast.Name | ast.Attribute) -> None:
        attrs: list[ast.Attribute] = []
        base: ast.expr = top
        while isinstance(base, ast.Attribute):
            attrs.append(base)
            base = base.value
        attrs.reverse()  # innermost first
        for node in attrs:
            # Rule dunders: no `__x__` attribute (__class__, __dict__, __globals__, __traceback__,
            # __getattribute__ ...), on anything.
            if _is_dunder(node.attr):
                self.flag("dunders", node, f"use of .{node.attr}")
                return
        if isinstance(top, ast.Name) and not isinstance(top.ctx, ast.Load):
            return  # a binding, checked where the module's bindings are
        path = self.dotted(top)
        if isinstance(top, ast.Attribute) and not isinstance(top.ctx, ast.Load):
            # Rule attributes: attributes are read, never assigned or deleted: no patching of
            # modules (triton.testing.do_bench = ...), flags (torch.backends...) or objects.
            self.flag("attributes", top, f"assignment to {path or '.' + top.attr}")
            return
        if isinstance(base, ast.Name) and base.id in self.aliases:
            if base.id in self.bad_aliases:
                return  # its import is rejected already
            attrs = self.check_module_chain(top, base, attrs)
            if attrs is None:
                return
        elif isinstance(base, ast.Name) and not self.defined(base.id):
            return  # an undefined name: the rule names reports it
        self.check_value_attributes(attrs)

    def check_module_chain(
        self, top: ast.expr, base: ast.Name, attrs: list[ast.Attribute]
    ) -> list[ast.Attribute] | None:
        """The rules on a chain from an import; the attributes past its allowed name (those of
        a value, `torch.float32.itemsize`), or None if the chain is rejected."""
        root = self.aliases[base.id]
        parts = root.split(".") + [a.attr for a in attrs]
        offset = len(root.split(".")) - 1
        nodes: list[ast.expr] = [base, *attrs]  # nodes[i]: the chain up to parts[offset + i]
        full = ".".join(parts)
        # Rule fallback: the op itself computed by torch instead of a Triton kernel
        # (triton.language's functions of the same name run inside one).
        if not full.startswith("triton.language.") and any(p in self.forbidden for p in parts[1:]):
            op = next(p for p in parts[1:] if p in self.forbidden)
            self.flag("fallback", top, f"use of {full}: .{op} computes the op")
            return None
        # The longest prefix of modules (namespaces), then the allowed name it leads to.
        k = 1
        while k < len(parts) and ".".join(parts[:k]) in self.namespaces:
            k += 1
        name = ".".join(parts[:k])
        if k == len(parts) and name in self.namespaces and not self.allowed_name(name):
            # Rule aliases: a module is only the base of an attribute: never stored, passed,
            # returned or held in a container (T = torch, f(tl), [torch], def f(t=torch),
            # lambda: tl), or its attributes would escape this rule.
            self.flag("aliases", top, f"{full} is a module, used as a value")
            return None
        # Rule modules: every attribute chain on a module is an allowed dotted name
        # (torch.os, torch.cuda, triton.runtime.cache, triton.testing are not).
        if not self.allowed_name(name):
            self.flag("modules", top, f"use of {full}" + (f": {name} is not allowed" if name != full else ""))
            return None
        node = nodes[max(k - 1 - offset, 0)]
        # Rule asm: inline assembly only where the problem allows it, or a vetted instruction.
        if "asm" in parts[k - 1] and not self.allow_asm and not self.vetted_asm(node):
            self.flag("asm", node, f"use of {name} (inline assembly is not allowed for this problem)")
            return None
        kit_name = name.startswith(KIT_PACKAGE + ".")
        if node is top and self.is_function(name) and not self.call_position(node) and not kit_name:
            # Rule aliases: an allowed function is called (or decorates, annotates, or is the
            # class isinstance checks against), not stored or passed under another name. The
            # kit's are the exception (a launch function handed to a launcher): they are the
            # library's own code, and what calls one under another name can only call it.
            self.flag("aliases", node, f"{name} is used as a value; call it")
            return None
        return attrs[k - 1 - offset :] if k - 1 - offset >= 0 else attrs

    def vetted_asm(self, node: ast.expr) -> bool:
        call = self.parents.get(node)
        if not (isinstance(call, ast.Call) and call.func is node):
            return False
        given = dict(zip(("asm", "constraints"), call.args, strict=False))
        given |= {k.arg: k.value for k in call.keywords}
        texts = [given.get(k) for k in ("asm", "constraints")]
        if not all(isinstance(t, ast.Constant) and isinstance(t.value, str) for t in texts):
            return False
        return (texts[0].value, texts[1].value) in VETTED_ASM

    def call_position(self, node: ast.expr) -> bool:
        parent = self.parents.get(node)
        if isinstance(parent, ast.Call) and parent.func is node:
            return True
        if node in self.decorators or node in self.annotations:
            return True
        if isinstance(parent, ast.Tuple):  # isinstance(x, (torch.Tensor, int))
            node, parent = parent, self.parents.get(parent)
        return (
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Name)
            and parent.func.id == "isinstance"
            and parent.args[1:2] == [node]
        )

    def check_value_attributes(self, attrs: list[ast.Attribute]) -> None:
        for node in attrs:
            # Rule fallback: a method that computes the op (weight.index_select, q.bmm).
            if node.attr in self.forbidden:
                self.flag("fallback", node, f"use of .{node.attr}, which computes the op")
                return
            allowed = node.attr in VALUE_ATTRIBUTES or node.attr in self.extra_attributes
            allowed = allowed or (node in self.kernel_nodes and node.attr in kernel_attributes())
            # Rule attributes: of a value that is not a module, only the attributes listed
            # (metadata, layout, allocation, casts; in a kernel the language's own methods):
            # no frames (.f_back, .gi_frame, .tb_frame), no str.format, no torch compute methods.
            if not allowed:
                self.flag("attributes", node, f"use of .{node.attr}, which is not an allowed attribute")
                return


# Rule text: the screen reads the text Python will run. Python decodes a module file by its
# coding declaration (PEP 263) while this screen parses the string it is given, so a source
# that declares another encoding (utf-7 turns a comment into code) is refused, as are control
# characters (a form feed, a lone carriage return) that the two readings could split lines on.
TEXT_CONTROLS = frozenset(chr(c) for c in range(32) if chr(c) not in "\t\n") | {"\x7f"}


def _text_violations(source: str) -> list[Violation]:
    try:
        data = source.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates
        return [Violation("text", 0, f"the source is not valid UTF-8 text ({exc.reason})")]
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        return [Violation("text", 0, f"unreadable coding declaration: {exc}")]
    if encoding not in ("utf-8", "utf-8-sig"):
        return [Violation("text", 0, f"declares the {encoding} encoding; only UTF-8 source is read")]
    for number, line in enumerate(source.split("\n"), start=1):
        bad = sorted(set(line) & TEXT_CONTROLS)
        if bad:
            return [Violation("text", number, f"control character {bad[0]!r}; only tabs and newlines")]
    return []


def screen(
    source: str,
    entry: str,
    forbidden_ops: tuple[str, ...] = (),
    *,
    allowed_extras: frozenset[str] = frozenset(),
    allow_inline_asm: bool = False,
) -> list[Violation]:
    """All violations of the rules in `source`; empty means it may run.

    `forbidden_ops` are the torch functions that compute the problem's op (its fallback), by
    attribute name: a candidate must do that work in a Triton kernel. `allowed_extras` are names
    the problem allows beyond the lists above: dotted (torch.cumsum) or attribute names (cumsum);
    `allow_inline_asm` lets kernels use tl.inline_asm_elementwise."""
    text = _text_violations(source)
    if text:
        return text
    try:
        tree = parse_source(source)
    except SyntaxError as exc:
        return [Violation("syntax", exc.lineno or 0, exc.msg)]
    defs = _def_line_violations(source, tree)
    return defs + _Screen(tree, forbidden_ops, frozenset(allowed_extras), allow_inline_asm).run(entry)


def _def_line_violations(source: str, tree: ast.Module) -> list[Violation]:
    """Rule text: Triton finds a kernel's source by its lines, not by Python's parse (the
    interpreter takes the function's last line that starts with `def `, the compiler its first
    that matches `def name(`), so a line that reads as a def must be one: inside a string, the
    kernel Triton runs would be text the screen never saw as code."""
    real = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return [
        Violation("text", number, "a line that starts with `def ` but defines no function (a string?)")
        for number, line in enumerate(source.split("\n"), start=1)
        if line.strip().startswith(("def ", "def\t", "async def")) and number not in real
    ]


def screen_problem(source: str, entry: str, problem) -> list[Violation]:
    """`screen` with `problem`'s own rules: its forbidden ops, declared extras and inline asm."""
    return screen(
        source,
        entry,
        problem.forbidden_ops,
        allowed_extras=frozenset(getattr(problem, "screen_extras", ())),
        allow_inline_asm=bool(getattr(problem, "allow_inline_asm", False)),
    )


def screen_candidate(candidate: Candidate) -> EvalResult | None:
    """The screen as every backend applies it before anything runs: the problem's own rules
    included. A static_rejected result naming each violation, or None if the candidate may run."""
    from search_space import get_problem

    try:
        problem = get_problem(candidate.problem)
    except ValueError as exc:
        violations_text = str(exc)
    else:
        violations = screen_problem(candidate.source, candidate.entry, problem)
        if not violations:
            return None
        violations_text = "; ".join(str(v) for v in violations)
    return EvalResult(
        status=Status.STATIC_REJECTED,
        problem=candidate.problem,
        candidate_id=candidate.id,
        message=violations_text,
    )
