"""The adversarial suite: candidates that try to fool, crash or escape the evaluator.

Each file in `adversarial/` says in its docstring what it tries and, in a header line
`# expect: STATUS | FRAGMENT`, the status it must get and a fragment of the message. Files marked
`# base: yes` are appended to `adversarial/base.py`, a correct kernel, so that the only thing
wrong with them is the exploit (`control_correct.py` proves the base passes).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from sandbox import Candidate, EvalResult, LocalBackend, Status
from sandbox.local import network_namespace_prefix

HERE = Path(__file__).parent / "adversarial"
CASES = sorted(p for p in HERE.glob("*.py") if p.name != "base.py")


def _header(text: str, key: str) -> str:
    line = next(line for line in text.splitlines() if line.startswith(f"# {key}:"))
    return line.split(":", 1)[1].strip()


def _source(path: Path) -> tuple[str, Status, str]:
    text = path.read_text()
    status, _, fragment = _header(text, "expect").partition("|")
    if _header(text, "base") == "yes":
        text = (HERE / "base.py").read_text() + "\n\n" + text
    return text, Status(status.strip()), fragment.strip()


def test_the_suite_covers_every_exploit_and_fault() -> None:
    assert len(CASES) >= 15
    for path in CASES:
        assert path.read_text().startswith('"""'), f"{path.name} has no docstring saying what it tries"


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Future[EvalResult], Path, Path]]:
    """Every case evaluated once, two at a time: a worker keeps one core busy, and the cases that
    run a worker (or spin until the timeout) would otherwise leave the second core of a small CI
    machine idle. Case name -> (its evaluation, its scratch directory, a canary directory beside it)."""
    # Only the cases this session runs: `-k control_correct` evaluates that one alone.
    selected = {
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_adversarial_candidate_gets_its_status"
    }
    runs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for path in sorted(selected):
            source, expected, _ = _source(path)
            root = tmp_path_factory.mktemp(path.stem)
            scratch, canary = root / "scratch", root / "canary"
            canary.mkdir()
            (canary / "keep").write_text("unchanged")
            # Cases that must time out get a short limit; the rest a generous one for slow CI machines.
            backend = LocalBackend(timeout_s=8 if expected == Status.TIMEOUT else 120, scratch_root=scratch)
            candidate = Candidate(problem="embedding_bag", source=source, entry="embedding_bag")
            runs[path.stem] = (
                pool.submit(backend.evaluate, candidate, trials=2, timing=False),
                scratch,
                canary,
            )
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_adversarial_candidate_gets_its_status(path: Path, outcomes) -> None:
    _, expected, fragment = _source(path)
    run, scratch, canary = outcomes[path.stem]
    result = run.result()

    assert result.status == expected, (
        f"{path.name}: {result.status.value}: {result.message}\n{result.log_tail}"
    )
    assert fragment in result.message, result.message
    # Nothing left behind: the scratch directory is gone and nothing beside it was touched.
    assert [p.name for p in canary.iterdir()] == ["keep"] and (canary / "keep").read_text() == "unchanged"
    assert not scratch.exists() or not any(scratch.iterdir())


def test_worker_network_namespace_has_no_route_to_the_host(tmp_path: Path) -> None:
    """Even code that got past the screen could not connect: a listener on the host's loopback
    is unreachable from the worker's namespace."""
    prefix = network_namespace_prefix()
    if not prefix:
        pytest.skip("this OS does not allow a network namespace (unshare --net refused)")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[object] = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True)
    thread.start()
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)"
    done = subprocess.run(
        [*prefix, sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ["PATH"]},
    )
    server.close()
    # An empty namespace has no route at all ("Network is unreachable"); a refused connection
    # would already mean a reachable host.
    assert done.returncode != 0 and "Network is unreachable" in done.stderr, done.stderr
    assert not accepted
