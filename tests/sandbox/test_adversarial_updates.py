"""The adversarial suite for ops that update their arguments in place (Problem.updates), on
embedding_bags_update: candidates that try to be accepted while wrong, or faster than honest,
through what an update changes in the sandbox (a writable shared region for the updated
arguments, their results read back from it, the other inputs still read-only, trial 0's second
call on a copy of the inputs).

Each file in `adversarial/updates/` says in its docstring what it tries, and in header lines, as
the files of `adversarial/` do: `# expect: STATUS | FRAGMENT` (alternatives of the fragment
separated by `||`), `# expect-gpu:` where a GPU answers otherwise, `# timing: yes` for cases
timed as well as checked, `# cpu-only:` for cases whose channel exists only in the interpreter.
A case `# from: template` is the problem's template at its default knobs
(search_space.template.get_template("embedding_bags_update").render({}), which
tests/kernels/test_embedding_bags_update.py shows the sandbox accepts) with the defect its
`EDITS` make: (search, replace) pairs, each found exactly once.

A case with a `# hole:` line is one the sandbox accepts today although it must not (its
`# expect:` says what it gets now): run with RECFORGE_RUN_HOLES=1, each is expected to fail
(strict xfail) until the hole it names is closed.
"""

from __future__ import annotations

import ast
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from case_headers import header as _header
from case_headers import open_holes_only

from sandbox import Candidate, EvalResult, LocalBackend, Status, isolation
from search_space.template import get_template, parse_source

PROBLEM = "embedding_bags_update"
HERE = Path(__file__).parent / "adversarial" / "updates"
ALL = sorted(HERE.glob("*.py"))

pytestmark = pytest.mark.skipif(
    isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}"
)


HOLES = [p for p in ALL if _header(p.read_text(), "hole", "") != ""]
CASES = [p for p in ALL if p not in HOLES]


def _source(path: Path) -> str:
    """The candidate the case describes: the template with its EDITS, or the file itself."""
    text = path.read_text()
    if _header(text, "from", "") != "template":
        return text
    [edits] = [
        ast.literal_eval(node.value)
        # Under the lock every parse takes: the corpus's evaluations screen sources in threads
        # meanwhile (search_space.template.parse_source).
        for node in parse_source(text).body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["EDITS"]
    ]
    source = get_template(PROBLEM).render({})
    for search, replace in edits:
        assert source.count(search) == 1, f"{path.name}: {search!r} is not in the template exactly once"
        source = source.replace(search, replace)
    return source


def _expected(path: Path) -> tuple[Status, list[str]]:
    text = path.read_text()
    expect = _header(text, "expect")
    if torch.cuda.is_available():
        expect = _header(text, "expect-gpu", expect)
    status, _, fragment = expect.partition("|")
    return Status(status.strip()), [f.strip() for f in fragment.split("||")]


def _evaluate_all(paths: list[Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each case evaluated once, two at a time (RECFORGE_CORPUS_PARALLEL on a larger host): case
    name -> (its evaluation, its scratch directory)."""
    runs: dict[str, tuple[Future[EvalResult], Path]] = {}
    pool = ThreadPoolExecutor(max_workers=int(os.environ.get("RECFORGE_CORPUS_PARALLEL", "2")))
    for path in paths:
        scratch = tmp_path_factory.mktemp(path.stem) / "scratch"
        backend = LocalBackend(timeout_s=240, scratch_root=scratch)
        candidate = Candidate(problem=PROBLEM, source=_source(path), entry=PROBLEM)
        timing = _header(path.read_text(), "timing", "no") == "yes"
        runs[path.stem] = (pool.submit(backend.evaluate, candidate, trials=2, timing=timing), scratch)
    pool.shutdown(wait=False)
    return runs


def _cpu_only(path: Path) -> bool:
    return _header(path.read_text(), "cpu-only", "") != ""


def _selected(request: pytest.FixtureRequest, test_name: str) -> list[Path]:
    """The cases this session runs of `test_name` (`-k stale_state` evaluates that one alone)."""
    return sorted(
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", None) == test_name
        and not (_cpu_only(item.callspec.params["path"]) and torch.cuda.is_available())
    )


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _evaluate_all(_selected(request, "test_update_attack_is_refused"), tmp_path_factory)


def _marks(path: Path) -> list:
    reason = f"{path.stem}: its channel exists only in the interpreter"
    return [pytest.mark.skipif(_cpu_only(path) and torch.cuda.is_available(), reason=reason)]


def test_every_case_says_what_it_tries() -> None:
    assert len(CASES) >= 10
    for path in ALL:
        text = path.read_text()
        assert text.startswith('"""'), f"{path.name} has no docstring saying what it tries"
        status, _ = _expected(path)
        if path in HOLES:
            assert status == Status.OK, f"{path.name}: a hole's '# expect:' is what it gets today"
        else:
            assert status != Status.OK, f"{path.name}: an attack the suite runs must be refused"
        _source(path)  # its edits apply to today's template


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first case waits for the whole corpus (about a minute on 2 cores)
@pytest.mark.parametrize("path", [pytest.param(p, marks=_marks(p), id=p.stem) for p in CASES])
def test_update_attack_is_refused(path: Path, outcomes) -> None:
    expected, fragments = _expected(path)
    run, scratch = outcomes[path.stem]
    result = run.result()
    got = f"{path.name}: {result.status.value}: {result.message}\n{result.log_tail}"
    assert result.status == expected, got
    assert any(f in result.message for f in fragments), result.message
    assert not scratch.exists() or not any(scratch.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(900)
@open_holes_only
@pytest.mark.xfail(strict=True, reason="an open hole of the sandbox: the case is accepted")
@pytest.mark.parametrize("path", HOLES, ids=[p.stem for p in HOLES])
def test_open_hole_is_refused(path: Path, tmp_path: Path) -> None:
    backend = LocalBackend(timeout_s=600, scratch_root=tmp_path / "scratch")
    timing = _header(path.read_text(), "timing", "no") == "yes"
    result = backend.evaluate(Candidate(problem=PROBLEM, source=_source(path), entry=PROBLEM), timing=timing)
    assert result.status != Status.OK, f"{path.name} is accepted: {_header(path.read_text(), 'hole')}"
