"""The worker's `evaluate` called in this process: every outcome yields a result (fast twins of
the slow end-to-end tests in test_local_backend.py; a correct candidate's full check, seconds
even here, is proven there alone, by test_default_template_is_ok)."""

import io
import sys
from pathlib import Path

import pytest
import torch

from sandbox.protocol import EvalRequest
from sandbox.result import EvalResult, Status
from sandbox.worker import baseline_providers, evaluate
from search_space import get_problem
from search_space.attention import compiled_reference, dense_attention
from search_space.embedding_bag import CHECK_SHAPES, ENTRY, TEMPLATE

DEFAULT_SOURCE = TEMPLATE.render({})
ENTRY_BODY = "    num_bags, dim = offsets.numel() - 1, weight.shape[1]\n"


@pytest.fixture(autouse=True)
def _forget_candidate_module():
    # load_candidate registers the module as `candidate` for triton's source inspection.
    yield
    sys.modules.pop("candidate", None)


def _evaluate(tmp_path: Path, source: str) -> EvalResult:
    path = tmp_path / "candidate.py"
    path.write_text(source)
    request = EvalRequest(
        problem="embedding_bag",
        candidate_id="test",
        source_file=str(path),
        entry=ENTRY,
        timing=False,
        trials=1,
    )
    return evaluate(request, io.StringIO())


def test_import_failure_is_a_compile_error_with_traceback(tmp_path: Path) -> None:
    result = _evaluate(tmp_path, DEFAULT_SOURCE + "\nHELPER = _make_helper()\n")
    assert result.status == Status.COMPILE_ERROR
    assert result.message == "import failed: NameError: name '_make_helper' is not defined"
    assert "Traceback" in result.log_tail


def test_missing_entry_is_a_compile_error(tmp_path: Path) -> None:
    result = _evaluate(tmp_path, DEFAULT_SOURCE.replace(f"def {ENTRY}(", "def other("))
    assert result.status == Status.COMPILE_ERROR
    assert f"no callable {ENTRY!r}" in result.message


def test_raising_entry_is_a_runtime_error_naming_the_shape(tmp_path: Path) -> None:
    source = DEFAULT_SOURCE.replace(ENTRY_BODY, '    raise RuntimeError("gave up")\n' + ENTRY_BODY)
    result = _evaluate(tmp_path, source)
    assert result.status == Status.RUNTIME_ERROR
    assert result.message == f"{CHECK_SHAPES[0].describe()}: RuntimeError: gave up"
    assert "Traceback" in result.log_tail and result.checks == []


def test_reference_compile_of_a_jagged_reference_compiles_its_dense_part(monkeypatch) -> None:
    # embedding_bag's reference compiles whole, once per shape; the attention references keep
    # their loop over sequences and compile the dense attention of one, with dynamic shapes.
    # (torch.compile is faked: what matters is what it is asked to compile, and how.)
    seen = []

    def fake_compile(fn, **kwargs):
        seen.append((fn, kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    embedding = get_problem("embedding_bag")
    providers = baseline_providers(embedding, ["reference.compile"], torch.device("cuda"))
    assert providers["reference.compile"] is embedding.reference
    assert seen == [(embedding.reference, {"dynamic": False})]
    for name in ("jagged_attention", "gdpa", "target_attention", "jagged_attention_grad"):
        seen.clear()
        problem = get_problem(name)
        compiled = baseline_providers(problem, ["reference.compile"], torch.device("cuda"))[
            "reference.compile"
        ]
        assert seen == [(dense_attention, {"dynamic": True})], name
        assert compiled.func is problem.reference and compiled.keywords == {"attend": dense_attention}
        assert baseline_providers(problem, ["reference.compile"], torch.device("cpu")) == {}


def test_compiled_reference_computes_the_reference(monkeypatch) -> None:
    # The loop with a dense part traced by dynamo, dynamic shapes, gives the plain reference's
    # result. (The eager backend: no C++ build for inductor on a CPU; a GPU run times inductor.)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(fn, backend="eager", **kwargs))
    problem = get_problem("jagged_attention")
    shape = next(s for s in problem.check_shapes if s.dtype == "fp32")
    inputs = problem.make_inputs(shape, 0, torch.device("cpu"))
    want = problem.reference(*inputs.args, **inputs.kwargs)
    got = compiled_reference(problem.reference)(*inputs.args, **inputs.kwargs)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
