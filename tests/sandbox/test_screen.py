"""The static screen: every rule has an adversarial source it rejects, naming rule and line;
the rendered template passes."""

import pytest

from sandbox.screen import screen
from search_space import get_problem
from search_space.embedding_bag import ENTRY, TEMPLATE

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


def _with_body(body: str) -> str:
    return KERNEL.format(body=body)


def _with_header(line: str) -> str:
    return line + "\n" + _with_body("pass")


def test_minimal_kernel_passes() -> None:
    assert screen(_with_body("pass"), ENTRY) == []


def test_tma_descriptors_are_part_of_the_kernel_language() -> None:
    source = _with_header("from triton.tools.tensor_descriptor import TensorDescriptor")
    assert screen(source, ENTRY) == []
    assert [v.rule for v in screen(_with_header("import triton.tools.disasm"), ENTRY)] == ["imports"]


def test_rendered_template_passes() -> None:
    assert screen(TEMPLATE.render({}), ENTRY) == []
    assert screen(TEMPLATE.render({"ACC_3D": True, "EVICT_ROWS": "evict_first"}), ENTRY) == []


@pytest.mark.parametrize(
    ("source", "rule", "line", "detail"),
    [
        (_with_header("import os"), "imports", 1, "'os'"),
        (_with_header("import os.path"), "imports", 1, "'os.path'"),
        (_with_header("from subprocess import run"), "imports", 1, "'subprocess'"),
        (_with_header("from . import helper"), "imports", 1, "'.'"),
        (_with_header("import torch, ctypes"), "imports", 1, "'ctypes'"),
        (_with_body("import socket"), "imports", BODY_LINE, "'socket'"),
        (_with_body("f = open('/etc/passwd')"), "builtins", BODY_LINE, "open()"),
        (_with_body("exec('x = 1')"), "builtins", BODY_LINE, "exec()"),
        (_with_body("m = __import__('os')"), "builtins", BODY_LINE, "__import__()"),
        (_with_body("g = getattr(torch, 'cuda')"), "builtins", BODY_LINE, "getattr()"),
        (_with_body("torch.cuda.synchronize()"), "attributes", BODY_LINE, ".synchronize"),
        (_with_body("s = torch.cuda.Stream()"), "attributes", BODY_LINE, ".Stream"),
        (_with_body("e = torch.cuda.Event(enable_timing=True)"), "attributes", BODY_LINE, ".Event"),
        (_with_body("torch.manual_seed(0)"), "attributes", BODY_LINE, ".manual_seed"),
        (_with_body("c = torch._C"), "attributes", BODY_LINE, "._C"),
        (_with_body("b = __builtins__"), "attributes", BODY_LINE, "__builtins__"),
        (_with_body("k = (1).__class__.__subclasses__()"), "attributes", BODY_LINE, ".__subclasses__"),
    ],
    ids=[
        "import-os",
        "import-os-path",
        "from-subprocess",
        "relative-import",
        "import-list",
        "import-in-function",
        "open",
        "exec",
        "dunder-import",
        "getattr",
        "synchronize",
        "stream",
        "event",
        "manual-seed",
        "torch-C",
        "builtins-name",
        "subclasses",
    ],
)
def test_rule_violations_are_rejected(source: str, rule: str, line: int, detail: str) -> None:
    violations = screen(source, ENTRY)
    assert violations, f"screen accepted:\n{source}"
    match = [v for v in violations if v.rule == rule and v.line == line and detail in v.detail]
    assert match, f"expected rule {rule!r} at line {line} ({detail}), got {violations}"
    assert f"line {line}: rule '{rule}'" in str(match[0])


def test_missing_triton_kernel_is_rejected() -> None:
    source = _with_body("pass").replace("@triton.jit\n", "")
    violations = screen(source, ENTRY)
    assert [v.rule for v in violations] == ["kernel"]
    assert "@triton.jit" in str(violations[0])


def test_missing_entry_is_rejected() -> None:
    violations = screen(_with_body("pass"), "embedding_bag_fused")
    assert [v.rule for v in violations] == ["entry"]
    assert "'embedding_bag_fused'" in str(violations[0])


def test_entry_nested_in_a_class_is_not_an_entry() -> None:
    source = _with_body("pass").replace("def embedding_bag(", "class Op:\n  def embedding_bag(")
    assert [v.rule for v in screen(source, ENTRY)] == ["entry"]


def test_syntax_error_is_rejected_with_its_line() -> None:
    violations = screen(_with_body("x = = 1"), ENTRY)
    assert [(v.rule, v.line) for v in violations] == [("syntax", BODY_LINE)]


def test_all_violations_are_reported_in_line_order() -> None:
    source = _with_header("import os") + "\ntorch.cuda.synchronize()\n"
    violations = screen(source, ENTRY)
    assert [v.rule for v in violations] == ["imports", "attributes"]
    assert violations == sorted(violations, key=lambda v: v.line)


FORBIDDEN = get_problem("embedding_bag").forbidden_ops


@pytest.mark.parametrize(
    ("source", "rule", "detail"),
    [
        (_with_body("w = torch.load('cached.pt', weights_only=False)"), "torch", "torch.load"),
        (_with_body("w = torch.from_file('/dev/shm/x', size=4)"), "torch", "torch.from_file"),
        (_with_body("p = torch.multiprocessing.Process()"), "torch", "torch.multiprocessing"),
        (_with_body("m = torch.utils.cpp_extension.load_inline('m', '')"), "torch", "torch.utils"),
        (_with_body("torch.ops.load_library('evil.so')"), "torch", "torch.ops"),
        (_with_body("m = torch.hub.load('x', 'y')"), "torch", "torch.hub"),
        (_with_body("torch.backends.cuda.matmul.allow_tf32 = True"), "torch", "torch.backends"),
        (_with_body("torch.set_float32_matmul_precision('medium')"), "torch", "torch.set_float32"),
        (_with_body("f = torch.compile(lambda x: x)"), "torch", "torch.compile"),
        (_with_body("n = torch.cuda.device_count()"), "torch", "torch.cuda"),
        (_with_header("import torch as T") + "\nT.cuda.synchronize()\n", "attributes", ".synchronize"),
        (_with_header("from torch import cuda"), "torch", "torch.cuda"),
        (
            _with_body("return torch.nn.functional.embedding_bag(indices, weight, offsets)"),
            "fallback",
            ".embedding_bag",
        ),
        (_with_body("out = torch.zeros(3, 4).index_add_(0, indices, weight)"), "fallback", ".index_add_"),
        (_with_header("from torch.nn.functional import embedding_bag"), "imports", "torch.nn.functional"),
        (_with_body("return weight[indices] @ torch.ones(weight.shape[1], 1)"), "fallback", "@ operator"),
        (_with_body("w = weight.clone()\n    w @= weight.T"), "fallback", "@ operator"),
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
        "import-fallback",
        "matmul-operator",
        "matmul-augmented",
    ],
)
def test_torch_escapes_and_fallbacks_are_rejected(source: str, rule: str, detail: str) -> None:
    violations = screen(source, ENTRY, FORBIDDEN)
    assert any(v.rule == rule and detail in v.detail for v in violations), violations


def test_library_default_kernel_passes_with_the_problem_rules() -> None:
    import inspect

    import kernels.embedding_bag as default

    source = inspect.getsource(default)
    assert screen(source, "embedding_bag_forward", FORBIDDEN) == []
    assert screen(TEMPLATE.render({}), ENTRY, FORBIDDEN) == []


def test_triton_language_functions_named_like_a_fallback_pass() -> None:
    """`tl.gather` is a kernel-side gather, not torch's `gather` fallback."""
    source = _with_header("import triton.language as tl") + "\nx = tl.gather\n"
    assert not [v for v in screen(source, ENTRY, FORBIDDEN) if v.rule == "fallback"]
    assert [v.rule for v in screen(_with_body("x = weight.gather(0, indices)"), ENTRY, FORBIDDEN)] == [
        "fallback"
    ]
