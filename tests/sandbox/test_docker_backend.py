"""The Docker backend end to end: LocalBackend's statuses from a container, and the container's
rules (no network, no writes outside the per-evaluation directory, memory limit, timeout) tried
from inside it.

Skipped without a reachable daemon; `make test` starts one first where it can (`make engine`).
Each containerized evaluation costs 6-10 s on a small CPU machine, so each outcome gets one
candidate, and the comparison with LocalBackend runs the two backends side by side.
"""

import json
import os
import secrets
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("docker")

from docker.errors import NotFound  # noqa: E402
from docker.models.containers import ContainerCollection  # noqa: E402

from sandbox import Candidate, EvalResult, LocalBackend, Status  # noqa: E402
from sandbox.docker_backend import DockerBackend  # noqa: E402
from sandbox.docker_image import REPO_ROOT, DockerUnavailable, docker_client  # noqa: E402
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
    return Candidate(problem="embedding_bag", source=source, entry=ENTRY, origin="human")


CASES = {
    "correct": (DEFAULT_SOURCE, {"trials": 1}),
    "wrong": (_edit("acc = acc / tl.maximum", "acc = acc * 2 / tl.maximum"), {"timing": False, "trials": 1}),
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
def created(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Ids of the containers the backend creates, so a test can check they are gone."""
    ids: list[str] = []
    create = ContainerCollection.create

    def recording_create(self, *args, **kwargs):
        container = create(self, *args, **kwargs)
        ids.append(container.id)
        return container

    monkeypatch.setattr(ContainerCollection, "create", recording_create)
    return ids


def _assert_removed(ids: list[str]) -> None:
    client = docker_client()
    for container_id in ids:
        with pytest.raises(NotFound):
            client.containers.get(container_id)


def test_correct_candidate_is_ok(outcomes) -> None:
    result, _, scratch = outcomes["correct"]
    assert result.status == Status.OK, f"{result.message}\n{result.log_tail}"
    # every check shape, then the no-op proof (trial -1)
    assert {c.shape for c in result.checks[:-1]} == {s.name for s in CHECK_SHAPES}
    assert result.checks[-1].trial == -1 and all(c.ok for c in result.checks)
    assert result.device is not None and result.device.interpreted  # no GPU passed through here
    assert result.timings and all(t.candidate.median_us > 0 for t in result.timings)
    assert list(scratch.iterdir()) == []  # the per-evaluation directory is removed afterwards


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


def test_forbidden_import_is_rejected_without_a_container(tmp_path: Path, created: list[str]) -> None:
    source = _edit("import torch\n", "import socket\nimport torch\n")
    result = DockerBackend(scratch_root=tmp_path).evaluate(_candidate(source))
    assert result.status == Status.STATIC_REJECTED
    assert "rule 'imports': import of 'socket'" in result.message
    assert created == []


# Runs in the sandbox: tries each way out and prints what happened as JSON.
PROBE = """
import errno, json, socket, sys
port, paths = int(sys.argv[1]), sys.argv[2:]
report = {"interfaces": [name for _, name in socket.if_nameindex()], "writes": {}, "connect": {}}
for path in paths:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        report["writes"][path] = "written"
    except OSError as exc:
        report["writes"][path] = errno.errorcode[exc.errno]
for host in ("127.0.0.1", "192.0.2.1"):
    try:
        socket.create_connection((host, port), timeout=5).close()
        report["connect"][host] = "connected"
    except OSError as exc:
        report["connect"][host] = errno.errorcode.get(exc.errno, str(exc))
print(json.dumps(report))
"""


def test_the_container_has_no_network_and_writes_only_its_directories(
    tmp_path: Path, created: list[str]
) -> None:
    io_dir = tmp_path / "io"
    io_dir.mkdir()
    name = f"probe-{secrets.token_hex(4)}"
    outside = [
        f"{REPO_ROOT}/{name}",
        f"{sys.prefix}/{name}",
        f"{sys.base_prefix}/{name}",
        f"/{name}",
        f"/etc/{name}",
    ]
    inside = [f"/io/{name}", f"/scratch/{name}", f"/tmp/{name}"]
    # A service on the host's loopback: the container's 127.0.0.1 is its own, so it must not
    # reach this.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        run = DockerBackend(timeout_s=60).run_in_sandbox(
            [sys.executable, "-c", PROBE, str(port), *outside, *inside], io_dir
        )
    assert run.exit_code == 0, run.log
    report = json.loads(run.log.strip().splitlines()[-1])
    assert report["interfaces"] == ["lo"]
    assert report["connect"] == {"127.0.0.1": "ECONNREFUSED", "192.0.2.1": "ENETUNREACH"}
    assert report["writes"] == {**dict.fromkeys(outside, "EROFS"), **dict.fromkeys(inside, "written")}
    # On the host, only the per-evaluation directory holds a file; /tmp and /scratch were tmpfs.
    assert [p.name for p in io_dir.iterdir()] == [name]
    for path in [*outside, f"/tmp/{name}", f"/scratch/{name}"]:
        assert not os.path.exists(path), path
    _assert_removed(created)


def test_memory_hog_is_killed_and_reported(tmp_path: Path, created: list[str]) -> None:
    # 16 GiB of ones, every page written, against a 1 GiB limit.
    source = _edit(ENTRY_BODY, "    hog = [torch.ones(1 << 26) for _ in range(64)]\n" + ENTRY_BODY)
    backend = DockerBackend(timeout_s=120, mem_limit="1g", scratch_root=tmp_path)
    result = backend.evaluate(_candidate(source), timing=False, trials=1)
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    assert "out of memory: the container hit its 1g memory limit" in result.message
    _assert_removed(created)


def test_hanging_entry_times_out_and_its_container_is_removed(tmp_path: Path, created: list[str]) -> None:
    source = _edit(ENTRY_BODY, "    while True:\n        pass\n" + ENTRY_BODY)
    result = DockerBackend(timeout_s=8, scratch_root=tmp_path).evaluate(
        _candidate(source), timing=False, trials=1
    )
    assert result.status == Status.TIMEOUT, f"{result.message}\n{result.log_tail}"
    assert result.message == "killed after 8 s"
    assert 8 <= result.wall_s < 20
    assert len(created) == 1
    _assert_removed(created)
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
