"""The Docker backend end to end: the judge on this host, its runner in a container, with
LocalBackend's statuses, and the container's rules (no network, no writes outside the runner's
scratch directory, memory limit, timeout) tried from inside it.

Skipped without a reachable daemon; `make test` starts one first where it can (`make engine`).
Each containerized evaluation costs 6-10 s on a small CPU machine, so each outcome gets one
candidate, and the comparison with LocalBackend runs the two backends side by side.
"""

import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("docker")

from docker.errors import NotFound  # noqa: E402

from sandbox import Candidate, EvalResult, LocalBackend, Status  # noqa: E402
from sandbox.docker_backend import LABEL, DockerBackend  # noqa: E402
from sandbox.docker_image import REPO_ROOT, DockerUnavailable, docker_client  # noqa: E402
from sandbox.judge import evaluate  # noqa: E402
from sandbox.protocol import EvalRequest  # noqa: E402
from search_space.embedding_bag import CHECK_SHAPES, ENTRY, TEMPLATE  # noqa: E402

try:
    docker_client()
except DockerUnavailable as exc:
    pytest.skip(f"no Docker daemon here ({exc})", allow_module_level=True)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

DEFAULT_SOURCE = TEMPLATE.render({})
# First statement of the rendered entry's body: code injected before it runs on every call.
ENTRY_BODY = "    num_bags, dim = offsets.numel() - 1, weight.shape[1]\n"


def _edit(old: str, new: str) -> str:
    assert DEFAULT_SOURCE.count(old) == 1, f"template changed: {old!r} no longer appears once"
    return DEFAULT_SOURCE.replace(old, new)


def _candidate(source: str) -> Candidate:
    return Candidate(problem="embedding_bag", source=source, entry=TEMPLATE.entry, origin="human")


CASES = {
    "correct": (DEFAULT_SOURCE, {"trials": 1}),
    "wrong": (
        _edit("acc_BD = acc_BD / tl.maximum", "acc_BD = acc_BD * 2 / tl.maximum"),
        {"timing": False, "trials": 1},
    ),
    "raising": (
        _edit(ENTRY_BODY, '    raise RuntimeError("candidate gave up")\n' + ENTRY_BODY),
        {"timing": False, "trials": 1},
    ),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[EvalResult, EvalResult, Path]]:
    """Each case evaluated by both backends at once: name -> (docker, local, docker scratch)."""
    results = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, (source, kwargs) in CASES.items():
            scratch = tmp_path_factory.mktemp(f"docker-{name}")
            docker_run = pool.submit(
                DockerBackend(timeout_s=120, scratch_root=scratch).evaluate, _candidate(source), **kwargs
            )
            local = LocalBackend(timeout_s=120, scratch_root=tmp_path_factory.mktemp(f"local-{name}"))
            local_run = pool.submit(local.evaluate, _candidate(source), **kwargs)
            results[name] = (docker_run.result(), local_run.result(), scratch)
    return results


@pytest.fixture
def created(tmp_path: Path) -> Callable[[], list[str]]:
    """The ids of the sandbox's containers this test created (by the judge, in this process or in
    the judge processes a backend starts), from the daemon's events, so a test can check they are
    gone. The label names each container's runner directory: containers of other tests, in the
    same second or on another worker, are not this test's."""
    client = docker_client()
    since = int(time.time()) - 1

    def ids() -> list[str]:
        events = client.events(
            since=since,
            until=int(time.time()) + 1,
            filters={"type": "container", "event": "create", "label": LABEL},
            decode=True,
        )
        return [
            event["id"]
            for event in events
            if event.get("Actor", {}).get("Attributes", {}).get(LABEL, "").startswith(str(tmp_path))
        ]

    return ids


def _assert_removed(ids: list[str]) -> None:
    client = docker_client()
    for container_id in ids:
        with pytest.raises(NotFound):
            client.containers.get(container_id)


def test_correct_candidate_is_ok(outcomes) -> None:
    result, _, scratch = outcomes["correct"]
    assert result.status == Status.OK, f"{result.message}\n{result.log_tail}"
    # every check shape, no-op proofs (trial -1) among them and in the timing, timed calls checked
    assert {(c.shape, c.dtype) for c in result.checks if c.trial >= 0} == {
        (s.name, s.dtype) for s in CHECK_SHAPES
    }
    assert any(c.trial == -1 for c in result.checks) and any(c.trial == -2 for c in result.checks)
    assert all(c.ok for c in result.checks), [c for c in result.checks if not c.ok]
    assert result.device is not None and result.device.interpreted  # no GPU passed through here
    assert result.timings and all(t.candidate.median_us > 0 for t in result.timings)
    assert list(scratch.iterdir()) == []  # the evaluation's directory is removed afterwards


def test_wrong_candidate_names_the_shape(outcomes) -> None:
    result, _, _ = outcomes["wrong"]
    assert result.status == Status.WRONG, f"{result.message}\n{result.log_tail}"
    # Doubling only changes mean bags: the first check shape in mean mode fails.
    first_mean = next(s for s in CHECK_SHAPES if s.params.get("mode") == "mean")
    assert result.message.startswith(first_mean.describe())
    assert "outside tolerance" in result.message


def test_statuses_match_the_local_backend(outcomes) -> None:
    for name, (in_docker, local, _) in outcomes.items():
        assert in_docker.status == local.status, f"{name}: {in_docker.message!r} vs {local.message!r}"
        # Messages agree up to the numbers, which depend on the random inputs.
        assert in_docker.message.split(":")[0] == local.message.split(":")[0], name
    raising, _, _ = outcomes["raising"]
    assert "RuntimeError: candidate gave up" in raising.message
    assert "candidate gave up" in raising.log_tail  # the traceback comes back out of the container


def test_forbidden_import_is_rejected_without_a_container(
    tmp_path: Path, created: Callable[[], list[str]]
) -> None:
    source = _edit("import torch\n", "import socket\nimport torch\n")
    result = DockerBackend(scratch_root=tmp_path).evaluate(_candidate(source))
    assert result.status == Status.STATIC_REJECTED
    assert "rule 'imports': import of 'socket'" in result.message
    assert created() == []


# The entry of a candidate whose runner is in the container (evaluated by the judge directly,
# which screens nothing): tries each way out and raises with what happened, as JSON.
PROBE = """
import errno, json, socket

def _try(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc))

def _write(path):
    with open(path, "w") as f:
        f.write("escaped")

def _connect(host):
    socket.create_connection((host, PORT), timeout=5).close()

def embedding_bag(weight, indices, offsets, **kwargs):
    report = {
        "interfaces": [name for _, name in socket.if_nameindex()],
        "connect": {host: _try(lambda host=host: _connect(host)) for host in ("127.0.0.1", "192.0.2.1")},
        "writes": {label: _try(lambda path=path: _write(path)) for label, path in WRITE.items()},
    }
    raise RuntimeError("PROBE " + json.dumps(report))
"""


def test_the_container_has_no_network_and_writes_only_its_directories(
    tmp_path: Path, created: Callable[[], list[str]]
) -> None:
    name = f"probe-{secrets.token_hex(4)}"
    outside = {
        "repository": f"{REPO_ROOT}/{name}",
        "sandbox package": f"{REPO_ROOT}/sandbox/{name}",
        "prefix": f"{sys.prefix}/{name}",
        "base prefix": f"{sys.base_prefix}/{name}",
        "root": f"/{name}",
        "etc": f"/etc/{name}",
    }
    inside = {"scratch": f"/scratch/{name}", "tmp": f"/tmp/{name}"}
    runner_dir = tmp_path / "runner"
    runner_dir.mkdir()
    backend = DockerBackend(timeout_s=60)
    # A service on the host's loopback: the container's 127.0.0.1 is its own, so it must not
    # reach this.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        write = {**outside, **inside}
        (runner_dir / "candidate.py").write_text(f"PORT = {port}\nWRITE = {write!r}\n" + PROBE)
        result = evaluate(
            EvalRequest(
                problem="embedding_bag",
                candidate_id="probe",
                source_file="/scratch/candidate.py",
                entry=ENTRY,
                runner_dir=str(runner_dir),
                timing=False,
                timeout_s=60,
                isolation="docker",
                docker={
                    "image": backend.image,
                    "mem_limit": "2g",
                    "cpus": 1.0,
                    "gpus": False,
                    "timeout_s": 60,
                },
            )
        )
        listener.settimeout(0)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    report = json.loads(result.message.split("PROBE ", 1)[1])
    assert report["interfaces"] == ["lo"]
    assert report["connect"] == {"127.0.0.1": "ECONNREFUSED", "192.0.2.1": "ENETUNREACH"}
    # Refused outside (read-only mounts, or a mount point's parent the container's user cannot
    # write: which errno comes first depends on where the checkout lies), allowed inside.
    assert {k: v for k, v in report["writes"].items() if k in inside} == dict.fromkeys(inside, "ok")
    refused = {k: v for k, v in report["writes"].items() if k in outside}
    assert set(refused) == set(outside) and set(refused.values()) <= {"EROFS", "EACCES"}, refused
    # On the host, only the runner's scratch directory holds a file; /tmp was the container's.
    assert (runner_dir / name).read_text() == "escaped"
    for path in [*outside.values(), f"/tmp/{name}", f"/scratch/{name}"]:
        assert not os.path.exists(path), path
    assert len(created()) == 1
    _assert_removed(created())


def test_memory_hog_is_killed_and_reported(tmp_path: Path, created: Callable[[], list[str]]) -> None:
    # 16 GiB of ones, every page written, against a 1 GiB limit.
    source = _edit(ENTRY_BODY, "    hog = [torch.ones(1 << 26) for _ in range(64)]\n" + ENTRY_BODY)
    backend = DockerBackend(timeout_s=120, mem_limit="1g", scratch_root=tmp_path)
    result = backend.evaluate(_candidate(source), timing=False, trials=1)
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    assert "the runner died: out of memory (the container's 1g limit)" in result.message
    assert len(created()) == 1
    _assert_removed(created())


def test_hanging_entry_times_out_and_its_container_is_removed(
    tmp_path: Path, created: Callable[[], list[str]]
) -> None:
    source = _edit(ENTRY_BODY, "    while True:\n        pass\n" + ENTRY_BODY)
    result = DockerBackend(timeout_s=8, scratch_root=tmp_path).evaluate(
        _candidate(source), timing=False, trials=1
    )
    assert result.status == Status.TIMEOUT, f"{result.message}\n{result.log_tail}"
    assert result.message.startswith("killed after 8 s (") and "no answer" in result.message
    assert 8 <= result.wall_s < 20
    assert len(created()) == 1
    _assert_removed(created())
    assert list(tmp_path.iterdir()) == []


def test_no_daemon_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/missing.sock")
    with pytest.raises(DockerUnavailable, match="make engine"):
        DockerBackend()


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        DockerBackend(timeout_s=0)
    with pytest.raises(ValueError, match="cpus"):
        DockerBackend(cpus=-1)
    # Triton on a GPU compiles C launchers: the host-built image has no compiler for them.
    with pytest.raises(ValueError, match="C compiler"):
        DockerBackend(gpus=True)
