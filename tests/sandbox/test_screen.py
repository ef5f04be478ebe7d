"""The static screen, an allowlist: every rule has sources it rejects, naming rule and line, one
class of escape per test; the library's kernels, every rendered template and an honest
candidate pass."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from kernels import kit
from kernels.registry import KernelLibrary
from sandbox.candidate import Candidate
from sandbox.result import Status
from sandbox.screen import screen, screen_candidate, screen_problem
from search_space import get_problem, problem_names
from search_space.embedding_bag import ENTRY, TEMPLATE
from search_space.template import get_template

REPO = Path(__file__).resolve().parents[2]

# A minimal module the screen accepts; each case below adds one offending line to it.
KERNEL = """\
import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    {body}
    return torch.empty(0)
"""
BODY_LINE = KERNEL.splitlines().index("    {body}") + 1  # where the offending line goes
KERNEL_LINE = KERNEL.splitlines().index("    offs = tl.arange(0, BLOCK)") + 1
FORBIDDEN = get_problem("embedding_bag").forbidden_ops
# Reads the GPU's clock: what a problem that allows inline assembly lets through.
INLINE_ASM = "x = tl.inline_asm_elementwise('mov.u32 $0, %globaltimer_lo;', '=r', [], dtype=tl.int32, pack=1)"


def _with_body(body: str) -> str:
    return KERNEL.format(body=body)


def _with_header(line: str) -> str:
    return line + "\n" + _with_body("pass")


def _in_kernel(line: str) -> str:
    """The offending line inside the @triton.jit kernel (rules that differ there)."""
    first = "    offs = tl.arange(0, BLOCK)\n"
    return _with_body("pass").replace(first, f"{first}    {line}\n")


def _rules(source: str, forbidden: tuple[str, ...] = FORBIDDEN, **kwargs) -> list[str]:
    return [v.rule for v in screen(source, ENTRY, forbidden, **kwargs)]


def _assert_rejected(source: str, rules: list[str], line: int = BODY_LINE, **kwargs) -> None:
    violations = screen(source, ENTRY, FORBIDDEN, **kwargs)
    assert [v.rule for v in violations] == rules, f"{violations}\n{source}"
    assert violations[0].line == line, violations
    assert f"line {line}: rule '{rules[0]}'" in str(violations[0])


# --- what passes ------------------------------------------------------------------------------


def test_minimal_kernel_passes() -> None:
    assert screen(_with_body("pass"), ENTRY) == []


def test_tma_descriptors_are_part_of_the_kernel_language() -> None:
    header = "from triton.tools.tensor_descriptor import TensorDescriptor"
    assert screen(_with_header(header), ENTRY) == []
    body = (
        "d = TensorDescriptor.from_tensor(weight, [16, 16])\n    e = TensorDescriptor(weight, [1], [1], [16])"
    )
    assert screen(header + "\n" + _with_body(body), ENTRY) == []
    assert _rules(_with_header("import triton.tools.disasm")) == ["imports"]


def test_rendered_template_passes() -> None:
    assert screen(TEMPLATE.render({}), TEMPLATE.entry, FORBIDDEN) == []
    rendered = TEMPLATE.render({"ACC_3D": True, "EVICT_ROWS": "evict_first"})
    assert screen(rendered, TEMPLATE.entry, FORBIDDEN) == []


@pytest.mark.parametrize("name", [n for n in problem_names() if get_problem(n).template])
def test_every_default_template_passes_with_its_problem_rules(name: str) -> None:
    problem, template = get_problem(name), get_template(name)
    assert screen_problem(template.render(template.defaults()), template.entry, problem) == []


@pytest.mark.parametrize(
    ("path", "entry", "problem"),
    [
        ("kernels/embedding_bag.py", "embedding_bag_forward", "embedding_bag"),
        ("kernels/embedding_bag.py", "embedding_bag_backward", "embedding_bag_backward"),
        ("kernels/kit/attention_forward.py", "launch_forward", "jagged_attention"),
        ("kernels/attention/backward.py", "launch_backward", "target_attention_grad"),
        *[
            (f"kernels/library/{e.source_file}", e.entry, e.op)
            for e in KernelLibrary(REPO / "kernels/library").entries()
        ],
    ],
)
def test_library_kernels_pass_with_their_problem_rules(path: str, entry: str, problem: str) -> None:
    """The default kernels and the library's frozen sources, which campaigns run as incumbents."""
    assert screen_problem((REPO / path).read_text(), entry, get_problem(problem)) == []


HONEST = '''\
"""A typical honest candidate: a Triton kernel and host code that only allocates and launches."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton import cdiv
from triton.language.extra import libdevice

SCALE = 1.0 / math.sqrt(2.0)


@triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=2)], key=["n"])
@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs * stride, mask=offs < n, other=0.0).to(tl.float32)
    y = libdevice.tanh(x) + tl.extra.cuda.libdevice.exp(x) * tl.math.exp2(x)
    total = tl.sum(x, axis=0) + x.sum(axis=0)
    tl.store(out_ptr + offs, (y * SCALE + total).to(out_ptr.dtype.element_ty), mask=offs < n)


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"unsupported input {type_name(weight)!r}")
    n = weight.numel()
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
    _scale_kernel[grid](weight, out, n, weight.stride(1))
    blocks = [cdiv(n, b) for b in (64, 128)]
    blocks.append(max(blocks))
    return out.view(-1, weight.shape[1]).contiguous()


def type_name(x: object) -> str:
    return "tensor" if isinstance(x, torch.Tensor) else "other"
'''


def test_honest_candidate_passes() -> None:
    assert screen(HONEST, ENTRY, FORBIDDEN) == []


# --- the audit's holes, one class per test ----------------------------------------------------


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ("x = torch.os.system('id')", "torch.os is not allowed"),
        ("x = torch.sys.modules", "torch.sys is not allowed"),
        ("x = torch.importlib.import_module('os')", "torch.importlib is not allowed"),
        ("x = torch.ctypes.CDLL(None)", "torch.ctypes is not allowed"),
        ("x = torch.builtins.open('/etc/passwd')", "torch.builtins is not allowed"),
        ("x = torch._ops.ops.aten.add(weight, weight)", "torch._ops is not allowed"),
        ("x = triton.runtime.cache.os.system('id')", "triton.runtime is not allowed"),
        ("x = triton.testing.subprocess.run(['id'])", "triton.testing is not allowed"),
        ("x = tl.core.builtins", "triton.language.core is not allowed"),
        ("x = triton.language.extra.modules", "triton.language.extra.modules"),
        ("x = tl.extra.cuda.globaltimer()", "triton.language.extra.cuda.globaltimer"),
        ("torch.cuda.synchronize()", "torch.cuda is not allowed"),
        ("x = torch.where(weight > 0, weight, 0)", "use of torch.where"),
    ],
)
def test_forbidden_modules_through_allowed_ones_are_rejected(body: str, detail: str) -> None:
    _assert_rejected(_with_body(body), ["modules"])
    assert detail in str(screen(_with_body(body), ENTRY, FORBIDDEN)[0])


def test_the_kit_is_importable_by_name_and_nothing_else_of_the_library() -> None:
    """Rule kit: names a kit module lists in __all__, imported by name; through them nothing
    of the module (its own imports, its caches) or of the rest of the library is reachable."""
    header = "from kernels.kit.attention import _dot, _sequence, jagged_attention_forward"
    assert screen(_with_header(header), ENTRY) == []
    # A kit function may be passed (a launch function handed to a launcher), as no other
    # allowed function may.
    assert screen(_with_header(header) + "\nx = _sequence\n", ENTRY) == []
    for line in [
        "import kernels.kit.attention",
        "from kernels import kit",  # the package, through which its modules would be values
        "from kernels.kit import attention",
        "from kernels.kit.attention import torch",  # the module's own import
        "from kernels.kit.attention import _CAPABILITY_MAJOR",  # not exported
        "from kernels.kit import kit_hash",
        "from kernels import registry",
        "from kernels.attention import backward",
    ]:
        assert _rules(_with_header(line))[:1] == ["imports"], line
    source = "from kernels.kit.attention import _dot\n" + _with_body("x = _dot.fn")
    assert "use of .fn" in " ".join(str(v) for v in screen(source, ENTRY, FORBIDDEN))
    # However an import of the kit is spaced, the candidate's id carries the kit's hash.
    spaced = "from kernels . kit . attention import _dot"
    assert screen(_with_header(spaced), ENTRY) == [] and kit.uses_kit(spaced)


def test_torch_ops_through_torch_internals_are_the_ops_fallback() -> None:
    violations = screen(_with_body("x = torch._ops.ops.aten.mm(weight, weight)"), ENTRY, FORBIDDEN)
    assert [(v.rule, v.line) for v in violations] == [("fallback", BODY_LINE)]
    assert "torch._ops.ops.aten.mm: .mm computes the op" in violations[0].detail


@pytest.mark.parametrize(
    "body",
    [
        "T = torch",
        "x = tl",
        "T, n = torch, 1",
        "(T := torch)",
        "def f(t=torch): pass",
        "g = lambda: torch",
        "g = lambda t=tl: t",
        "x = [torch]",
        "x = {'m': triton}",
        "print(torch)",
        "x = torch[0]",
        "return tl",
        "x = triton.language",
        "f = torch.empty",
        "f = triton.cdiv",
        "f = tl.load",
        "def tl(x): pass",
        "for torch in range(3): pass",
        "import math as tl",
    ],
)
def test_local_aliases_of_modules_and_their_functions_are_rejected(body: str) -> None:
    _assert_rejected(_with_body(body), ["aliases"])


def test_an_alias_in_one_scope_cannot_rename_another_module() -> None:
    """Names resolve per module: `tl` names triton.language everywhere, so no function may make
    it torch (tl.load would be torch.load there) or take it as a parameter."""
    _assert_rejected(_with_body("import torch as tl"), ["aliases"])
    assert _rules(_in_kernel("pass").replace("(x_ptr, n,", "(x_ptr, tl, n,")) == ["aliases"]


@pytest.mark.parametrize(
    ("body", "rules"),
    [
        ("x = getattr(torch, 'ma' + 'tmul')", ["builtins", "aliases"]),
        ("x = getattr(weight, 'ma' + 'tmul')(weight)", ["builtins"]),
        ("setattr(weight, 'data', weight)", ["builtins"]),
        ("x = hasattr(weight, 'sum')", ["builtins"]),
        ("x = vars(weight)", ["builtins"]),
        ("x = globals()['torch']", ["builtins"]),
        ("x = locals()", ["builtins"]),
        ("x = type('X', (), {})", ["builtins"]),
        ("x = object()", ["builtins"]),
        ("x = super()", ["builtins"]),
        ("x = eval('1')", ["builtins"]),
        ("x = compile('1', 'f', 'eval')", ["builtins"]),
        ("x = torch.__dict__['matmul']", ["dunders"]),
        ("x = weight.__dict__", ["dunders"]),
        ("x = torch.Tensor.__getattribute__(weight, 'sum')", ["dunders"]),
        ("x = weight.__class__.__mro__", ["dunders"]),
        ("x = embedding_bag.__globals__", ["dunders"]),
        ("x = __builtins__", ["dunders"]),
        ("x = __name__", ["dunders"]),
        ("def __getattr__(name): pass", ["dunders"]),
        ("x = '{0.__class__}'.format(weight)", ["attributes"]),
        ("x = str.format('{0.__class__}', weight)", ["attributes"]),
        ("import operator", ["imports"]),
        ("from operator import attrgetter", ["imports"]),
    ],
)
def test_attributes_by_string_dunders_and_namespaces_are_rejected(body: str, rules: list[str]) -> None:
    _assert_rejected(_with_body(body), rules)


@pytest.mark.parametrize(
    ("source", "rules", "line"),
    [
        (
            "class Sneaky:\n    def __torch_function__(cls, func, types, args=(), kw=None):\n        pass\n",
            ["statements", "dunders"],
            1,
        ),
        ("class Plain:\n    x = 1\n", ["statements"], 1),
        ("class Holder:\n    __slots__ = ('x',)\n", ["statements", "dunders"], 1),
        ("class Sub(int):\n    def __del__(self):\n        pass\n", ["statements", "dunders"], 1),
    ],
)
def test_classes_and_their_dunder_methods_are_rejected(source: str, rules: list[str], line: int) -> None:
    _assert_rejected(source + "\n" + _with_body("pass"), rules, line)


@pytest.mark.parametrize(
    ("body", "rules"),
    [
        ("import sys", ["imports"]),
        ("import inspect", ["imports"]),
        ("from sys import _getframe", ["imports"]),
        ("x = torch.sys._getframe(0)", ["modules"]),
        ("x = (i for i in ()).gi_frame", ["attributes"]),
        ("x = weight.f_back", ["attributes"]),
        ("x = weight.tb_frame.f_back", ["attributes"]),
        ("x = weight.f_globals", ["attributes"]),
        ("x = weight.cr_frame", ["attributes"]),
        ("x = RuntimeError().with_traceback(None)", ["attributes"]),
        ("x = RuntimeError().__traceback__", ["dunders"]),
    ],
)
def test_frames_are_unreachable(body: str, rules: list[str]) -> None:
    _assert_rejected(_with_body(body), rules)


def test_a_caught_exceptions_frame_is_unreachable() -> None:
    body = (
        "try:\n        raise ValueError()\n    except ValueError as e:\n        t = e.__traceback__.tb_frame"
    )
    _assert_rejected(_with_body(body), ["statements", "dunders"], BODY_LINE)


# --- the other rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "rule", "line", "detail"),
    [
        (_with_header("import os"), "imports", 1, "'os'"),
        (_with_header("import os.path"), "imports", 1, "'os.path'"),
        (_with_header("from subprocess import run"), "imports", 1, "'subprocess'"),
        (_with_header("from . import helper"), "imports", 1, "'.'"),
        (_with_header("from torch import *"), "imports", 1, "'*'"),
        (_with_header("from torch import cuda"), "imports", 1, "'cuda'"),
        (_with_header("from triton.language import core"), "imports", 1, "'core'"),
        (_with_header("import torch, ctypes"), "imports", 1, "'ctypes'"),
        (_with_header("from __future__ import braces"), "imports", 1, "'braces'"),
        (_with_body("import socket"), "imports", BODY_LINE, "'socket'"),
        (_with_body("f = open('/etc/passwd')"), "builtins", BODY_LINE, "open()"),
        (_with_body("exec('x = 1')"), "builtins", BODY_LINE, "exec()"),
        (_with_body("x = input()"), "builtins", BODY_LINE, "input()"),
        (_with_body("m = __import__('os')"), "dunders", BODY_LINE, "__import__"),
        (_with_body("def g(open): return open"), "builtins", BODY_LINE, "binds open"),
        (_with_body("x = np.zeros(3)"), "names", BODY_LINE, "np is not defined"),
        (_with_body("s = torch.cuda.Stream()"), "modules", BODY_LINE, "torch.cuda.Stream"),
        (_with_body("e = torch.cuda.Event(enable_timing=True)"), "modules", BODY_LINE, "torch.cuda.Event"),
        (_with_body("torch.manual_seed(0)"), "modules", BODY_LINE, "torch.manual_seed"),
        (_with_body("c = torch._C"), "modules", BODY_LINE, "torch._C"),
        (_with_body("k = (1).__class__.__subclasses__()"), "dunders", BODY_LINE, ".__class__"),
        (_with_body("weight.data = weight"), "attributes", BODY_LINE, "assignment to .data"),
        (_with_body("del weight.grad"), "attributes", BODY_LINE, "assignment to .grad"),
        (_with_body("x = weight.numpy()"), "attributes", BODY_LINE, ".numpy"),
        (_with_body("x = weight.untyped_storage()"), "attributes", BODY_LINE, ".untyped_storage"),
        (_with_body("x = weight.dtype.element_ty"), "attributes", BODY_LINE, ".element_ty"),
        (_with_body("x = _kernel.fn"), "attributes", BODY_LINE, ".fn"),
        (_with_body("x = math.pi"), "names", BODY_LINE, "math is not defined"),
        (_with_body("with torch.device('meta'): pass"), "statements", BODY_LINE, "with statement"),
        (_with_body("match weight:\n        case _: pass"), "statements", BODY_LINE, "match statement"),
        (_in_kernel(INLINE_ASM), "asm", KERNEL_LINE + 1, "inline assembly"),
    ],
    ids=[
        "import-os",
        "import-os-path",
        "from-subprocess",
        "relative-import",
        "star-import",
        "from-torch-import-cuda",
        "from-tl-import-submodule",
        "import-list",
        "future-feature",
        "import-in-function",
        "open",
        "exec",
        "input",
        "dunder-import",
        "builtin-as-parameter",
        "undefined-name",
        "stream",
        "event",
        "manual-seed",
        "torch-C",
        "subclasses",
        "attribute-assignment",
        "attribute-deletion",
        "numpy",
        "storage",
        "kernel-attribute-on-host",
        "jit-function-internals",
        "math-without-import",
        "with-device",
        "match",
        "inline-asm",
    ],
)  # fmt: skip
def test_rule_violations_are_rejected(source: str, rule: str, line: int, detail: str) -> None:
    violations = screen(source, ENTRY)
    assert violations, f"screen accepted:\n{source}"
    match = [v for v in violations if v.rule == rule and v.line == line and detail in v.detail]
    assert match, f"expected rule {rule!r} at line {line} ({detail}), got {violations}"
    assert f"line {line}: rule '{rule}'" in str(match[0])


def test_the_kernel_language_is_wider_inside_a_kernel() -> None:
    """Tensor methods of triton.language (x.trans(), ptr.dtype.element_ty) are the kernel's; on
    host code they would be torch's, and are not allowed there."""
    assert screen(_in_kernel("y = offs.trans().to(x_ptr.dtype.element_ty)"), ENTRY) == []
    assert _rules(_with_body("y = weight.trans()")) == ["attributes"]


def test_annotations_may_name_object_and_allowed_classes() -> None:
    body = "def f(x: object, d: torch.dtype = torch.float32) -> tuple[torch.Tensor, object]: return x, d"
    assert screen(_with_body(body), ENTRY) == []
    assert _rules(_with_body("x = object")) == ["builtins"]


def test_missing_triton_kernel_is_rejected() -> None:
    source = _with_body("pass").replace("@triton.jit\n", "")
    violations = screen(source, ENTRY)
    assert [v.rule for v in violations] == ["kernel"]
    assert "@triton.jit" in str(violations[0])


def test_a_kernel_by_another_name_is_a_kernel() -> None:
    source = "from triton import jit\n" + _with_body("pass").replace("@triton.jit\n", "@jit\n")
    assert screen(source, ENTRY) == []
    source = _with_body("pass").replace("@triton.jit\n", "@triton.heuristics({})\n")
    assert _rules(source) == ["kernel"]


def test_missing_entry_is_rejected() -> None:
    violations = screen(_with_body("pass"), "embedding_bag_fused")
    assert [v.rule for v in violations] == ["entry"]
    assert "'embedding_bag_fused'" in str(violations[0])


def test_entry_nested_in_a_class_is_not_an_entry() -> None:
    source = _with_body("pass").replace("def embedding_bag(", "class Op:\n  def embedding_bag(")
    assert sorted(v.rule for v in screen(source, ENTRY)) == ["entry", "statements"]


def test_syntax_error_is_rejected_with_its_line() -> None:
    violations = screen(_with_body("x = = 1"), ENTRY)
    assert [(v.rule, v.line) for v in violations] == [("syntax", BODY_LINE)]


def test_all_violations_are_reported_in_line_order() -> None:
    source = _with_header("import os") + "\ntorch.cuda.synchronize()\n"
    violations = screen(source, ENTRY)
    assert [v.rule for v in violations] == ["imports", "modules"]
    assert violations == sorted(violations, key=lambda v: v.line)


# --- the problem's own rules -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "rule", "detail"),
    [
        (_with_body("w = torch.load('cached.pt', weights_only=False)"), "modules", "torch.load"),
        (_with_body("w = torch.from_file('/dev/shm/x', size=4)"), "modules", "torch.from_file"),
        (_with_body("p = torch.multiprocessing.Process()"), "modules", "torch.multiprocessing"),
        (_with_body("m = torch.utils.cpp_extension.load_inline('m', '')"), "modules", "torch.utils"),
        (_with_body("torch.ops.load_library('evil.so')"), "modules", "torch.ops"),
        (_with_body("m = torch.hub.load('x', 'y')"), "modules", "torch.hub"),
        (_with_body("torch.backends.cuda.matmul.allow_tf32 = True"), "attributes", "torch.backends"),
        (_with_body("torch.set_float32_matmul_precision('medium')"), "modules", "torch.set_float32"),
        (_with_body("f = torch.compile(lambda x: x)"), "modules", "torch.compile"),
        (_with_body("n = torch.cuda.device_count()"), "modules", "torch.cuda"),
        (_with_header("import torch as T") + "\nT.cuda.synchronize()\n", "modules", "torch.cuda.synchronize"),
        (_with_header("from torch import cuda"), "imports", "'cuda'"),
        (
            _with_body("return torch.nn.functional.embedding_bag(indices, weight, offsets)"),
            "fallback",
            ".embedding_bag",
        ),
        (_with_body("out = torch.zeros(3, 4).index_add_(0, indices, weight)"), "fallback", ".index_add_"),
        (_with_body("out = weight.index_select(0, indices)"), "fallback", ".index_select"),
        (_with_header("from torch.nn.functional import embedding_bag"), "imports", "'torch.nn.functional'"),
        (_with_body("return weight[indices] @ torch.ones(weight.shape[1], 1)"), "fallback", "@ operator"),
        (_with_body("w = weight.clone()\n    w @= weight.T"), "fallback", "@ operator"),
        (_with_body("x = weight.repeat(2, 1)"), "attributes", ".repeat"),
        (_with_body("x = weight.softmax(0)"), "attributes", ".softmax"),
        (_with_body("x = weight.cumsum(0)"), "attributes", ".cumsum"),
    ],
    ids=[
        "load",
        "from-file",
        "multiprocessing",
        "cpp-extension",
        "ops-library",
        "hub",
        "tf32",
        "matmul-precision",
        "compile",
        "cuda",
        "aliased-torch",
        "from-torch-import-cuda",
        "functional-fallback",
        "index-add-fallback",
        "index-select-fallback",
        "import-fallback",
        "matmul-operator",
        "matmul-augmented",
        "compute-method",
        "compute-method-softmax",
        "compute-method-cumsum",
    ],
)
def test_torch_escapes_and_fallbacks_are_rejected(source: str, rule: str, detail: str) -> None:
    violations = screen(source, ENTRY, FORBIDDEN)
    assert any(v.rule == rule and detail in v.detail for v in violations), violations


def test_triton_language_functions_named_like_a_fallback_pass() -> None:
    """`tl.gather` is a kernel-side gather, not torch's `gather` fallback."""
    source = _in_kernel("y = tl.gather(offs, offs, axis=0)")
    assert screen(source, ENTRY, FORBIDDEN) == []
    assert _rules(_with_body("x = weight.gather(0, indices)")) == ["fallback"]


def test_allowed_extras_let_a_declared_name_through() -> None:
    dotted = _with_body("x = torch.where(weight > 0, weight, 0)")
    assert _rules(dotted) == ["modules"]
    assert screen(dotted, ENTRY, FORBIDDEN, allowed_extras=frozenset({"torch.where"})) == []
    method = _with_body("x = weight.cumprod(0)")
    assert _rules(method) == ["attributes"]
    assert screen(method, ENTRY, FORBIDDEN, allowed_extras=frozenset({"cumprod"})) == []
    # Imports of the declared name too; but the problem's forbidden ops stay forbidden.
    where = frozenset({"torch.where"})
    assert screen(_with_header("from torch import where"), ENTRY, allowed_extras=where) == []
    gather = _with_body("x = torch.gather(weight, 0, indices)")
    assert _rules(gather, allowed_extras=frozenset({"torch.gather"})) == ["fallback"]


@pytest.mark.parametrize(
    ("line", "when_allowed"),
    [
        (INLINE_ASM, []),
        # Not a literal, so not the vetted instruction whatever it holds.
        (
            "text = 'tanh.approx.f32 $0, $1;'\n    "
            "x = tl.inline_asm_elementwise(text, '=f,f', [offs], dtype=tl.float32, is_pure=True, pack=1)",
            [],
        ),
        ("f = tl.inline_asm_elementwise", ["aliases"]),
    ],
)
def test_inline_asm_is_rejected_unless_allowed(line: str, when_allowed: list[str]) -> None:
    source = _in_kernel(line)
    assert _rules(source) == ["asm"]
    assert _rules(source, allow_inline_asm=True) == when_allowed


def test_inline_asm_imported_by_name_is_inline_asm() -> None:
    source = "from triton.language import inline_asm_elementwise as asm\n" + _in_kernel(
        "x = asm('mov.u32 $0, 0;', '=r', [], dtype=tl.int32, is_pure=True, pack=1)"
    )
    assert _rules(source) == ["asm"]
    assert _rules(source, allow_inline_asm=True) == []


def test_the_vetted_tanh_instruction_is_allowed_as_a_literal() -> None:
    """The attention kernels' fast silu (kernels/kit/attention.py): one MUFU tanh, pure arithmetic."""
    line = (
        "x = tl.inline_asm_elementwise('tanh.approx.f32 $0, $1;', '=f,f', [offs], dtype=tl.float32, pack=1)"
    )
    assert screen(_in_kernel(line), ENTRY) == []


def test_screen_candidate_applies_the_problems_declarations(monkeypatch: pytest.MonkeyPatch) -> None:
    """A problem may declare `screen_extras` and `allow_inline_asm` (read with getattr, so that
    problems without them keep the plain rules)."""
    import search_space

    source = _in_kernel(INLINE_ASM).replace("torch.empty(0)", "torch.where(weight > 0, weight, 0)")
    candidate = Candidate(problem="embedding_bag", source=source, entry=ENTRY)
    rejected = screen_candidate(candidate)
    assert rejected is not None and rejected.status == Status.STATIC_REJECTED
    assert "rule 'asm'" in rejected.message and "rule 'modules'" in rejected.message
    declared = SimpleNamespace(forbidden_ops=FORBIDDEN, screen_extras=("torch.where",), allow_inline_asm=True)
    monkeypatch.setattr(search_space, "get_problem", lambda name: declared)
    assert screen_candidate(candidate) is None


# Names a blocklist would have listed: each is outside the allowlist.
FORBIDDEN_CALLS = (
    "open", "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "getattr",
    "setattr", "delattr", "breakpoint", "input", "memoryview", "type", "object", "super",
)  # fmt: skip
FORBIDDEN_TORCH = (
    "torch.utils", "torch.hub", "torch.multiprocessing", "torch.distributed", "torch.ops",
    "torch.library", "torch.backends", "torch.load", "torch.save", "torch.from_file",
    "torch.compile", "torch.jit", "torch.cuda", "torch.random", "torch.autograd", "torch.func",
    "torch.fx", "torch.export", "torch.set_", "torch.use_deterministic_algorithms",
    "torch.manual_seed", "torch.seed", "torch.initial_seed", "torch.nn", "torch._C", "torch.os",
)  # fmt: skip
FORBIDDEN_ATTRIBUTES = (
    "Stream", "Event", "synchronize", "stream", "current_stream", "default_stream", "set_stream",
    "_C", "_dynamo", "_inductor", "cuda_graph", "CUDAGraph", "graph", "f_back", "f_globals",
    "gi_frame", "tb_frame", "modules", "do_bench", "perf_counter", "elapsed_time", "manual_seed",
    "get_rng_state", "set_rng_state", "format",
)  # fmt: skip


@pytest.mark.parametrize("example", FORBIDDEN_CALLS + FORBIDDEN_TORCH + FORBIDDEN_ATTRIBUTES)
def test_names_a_blocklist_would_list_are_rejected(example: str) -> None:
    if example.startswith("torch."):
        body = f"x = {example}x" if example.endswith("_") else f"x = {example}"
    elif example in FORBIDDEN_CALLS:
        body = f"x = {example}()"
    else:
        body = f"x = weight.{example}"
    assert screen(_with_body(body), ENTRY, FORBIDDEN), body


def _prompt_rules() -> dict:
    from agent.llm.prompting import screen_rules
    from search_space import get_problem

    return screen_rules(get_problem("embedding_bag"))


def test_every_name_the_prompt_allows_passes_the_screen() -> None:
    """The system prompt states the allowlist (agent/llm/prompting.py: screen_rules): what it
    offers must pass, or the model is told to write what the screen refuses."""
    rules = _prompt_rules()
    # Module members and builtins are called (the screen refuses them as values: rule aliases).
    # torch.Tensor is a type to check against, never called (rule fallback).
    bodies = [
        f"x = isinstance(weight, {name})" if name == "torch.Tensor" else f"x = {name}()"
        for name in rules["torch"] + rules["triton"] + rules["builtins"]
    ]
    bodies += [f"x = weight.{name}" for name in rules["attributes"]]
    refused = {body: screen(_with_body(body), ENTRY, FORBIDDEN) for body in bodies}
    assert not {body: why for body, why in refused.items() if why}
    assert len(bodies) > 60


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        # utf-7 decodes "+AAo-" to a newline: what the screen reads as a comment Python runs.
        ("# -*- coding: utf-7 -*-\n", "declares the utf-7 encoding"),
        ("#!/usr/bin/env python\n# vim: set fileencoding=latin-1 :\n", "declares the iso-8859-1 encoding"),
        ("# a form feed \x0c splits lines differently\n", "control character '\\x0c'"),
        ("x = 1\r# a lone carriage return\n", "control character '\\r'"),
    ],
)
def test_source_python_would_read_otherwise_is_rejected(header: str, fragment: str) -> None:
    """Rule text: the screen reads the text Python will run, or refuses the source."""
    violations = screen(header + _with_body("pass"), ENTRY, FORBIDDEN)
    assert violations and violations[0].rule == "text" and fragment in violations[0].detail, violations


def test_utf8_source_with_a_utf8_declaration_and_non_ascii_text_passes() -> None:
    source = "# -*- coding: utf-8 -*-\n# Größe, naïve\n" + _with_body("pass")
    assert screen(source, ENTRY, FORBIDDEN) == []


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        # A def inside a string: the line Triton's interpreter (the last `def ` line) or compiler
        # (the first) would take as the kernel's.
        ('doc = """\ndef _kernel(x_ptr):\n    pass\n"""', "text"),
        ("x = torch.Tensor([1.0, 2.0])", "fallback"),
        ("try:\n        x = 1\n    except RuntimeError:\n        x = 2", "statements"),
    ],
)
def test_text_the_compiler_reads_otherwise_host_values_and_handlers_are_rejected(
    body: str, rule: str
) -> None:
    assert rule in _rules(_with_body(body))


@pytest.mark.parametrize(
    "decorator",
    [
        "@triton.autotune(configs=[triton.Config({})], key=[], pre_hook=lambda args: None)",
        "@triton.autotune(configs=[triton.Config({})], key=[], prune_configs_by={'early_config_prune': len})",
        "@triton.autotune(configs=[triton.Config({}, pre_hook=lambda args: None)], key=[])",
    ],
)
def test_hooks_in_the_autotuners_benchmarking_are_rejected(decorator: str) -> None:
    source = _with_body("pass").replace("@triton.jit\n", f"{decorator}\n@triton.jit\n", 1)
    assert "hooks" in _rules(source), source


def test_a_module_name_bound_only_in_dead_code_is_undefined() -> None:
    """The interpreter's Triton copies its globals (`_patch_attr`, a setattr by string) into
    the candidate's module: a name bound only where the code never runs would read them."""
    source = _with_body("x = _patch_attr") + "\nif False:\n    _patch_attr = None\n"
    assert "names" in _rules(source)


@pytest.mark.parametrize(
    "source, line, detail",
    [
        (_with_header("x = 0\ndel x"), 2, "deletes x, a module-level name"),
        (_with_body("global x; del x"), BODY_LINE, "deletes x, a module-level name"),
        (_with_header("interpreter_semantic = 0"), 1, "binds interpreter_semantic"),
        (_with_body("_InterpreterComparison = 1"), BODY_LINE, "binds _InterpreterComparison"),
    ],
    ids=["del-at-module-level", "del-of-a-global", "binds-interpreter-semantic", "binds-comparison"],
)
def test_module_names_the_interpreter_could_fill_are_rejected(source: str, line: int, detail: str) -> None:
    """A deleted module-level name is missing from the module's globals, where Triton's
    interpreter writes names of its own; the names its rewrite writes are never bound."""
    violations = screen(source, ENTRY)
    assert [(v.rule, v.line) for v in violations if detail in v.detail] == [("names", line)], violations


def test_a_local_name_may_be_deleted() -> None:
    assert screen(_with_body("y = weight.shape[0]; del y"), ENTRY) == []
