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


@pytest.mark.parametrize(
    "name, dynamic", [("embedding_bag", False), ("jagged_attention", None), ("gdpa", None)]
)
def test_reference_compile_takes_the_problems_dynamic(name: str, dynamic, monkeypatch) -> None:
    # References that loop over jagged sequences compile with automatic dynamic shapes; the
    # others once per shape, static. (The compile itself happens at the first call, on a GPU.)
    seen = {}

    def fake_compile(fn, **kwargs):
        seen.update(kwargs, fn=fn)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    problem = get_problem(name)
    providers = baseline_providers(problem, ["reference.compile"], torch.device("cuda"))
    assert providers["reference.compile"] is problem.reference
    assert seen == {"fn": problem.reference, "dynamic": dynamic}
    assert baseline_providers(problem, ["reference.compile"], torch.device("cpu")) == {}
