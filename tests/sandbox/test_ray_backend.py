"""The Ray backend on a local Ray cluster started here: a batch of candidates gets the local
backend's statuses in order, rejections never reach the cluster, and a task that dies is a
runtime error.

A local cluster takes about 5 s to start and an evaluation 4-12 s on a small CPU machine, so one
cluster serves the module, and the correct and the wrong candidate are evaluated only in the
batch, which every test about them shares, untimed, with one trial per check shape.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sandbox import Candidate, EvalResult, LocalBackend, Status
from sandbox.local import REPO_ROOT
from sandbox.ray_backend import RayBackend
from search_space.embedding_bag import CHECK_SHAPES, TEMPLATE

pytestmark = pytest.mark.slow

DEFAULT_SOURCE = TEMPLATE.render({})
MEAN = "acc_BD = acc_BD / tl.maximum"
# Wrong only in mean mode: the first check shape it fails is the first mean one.
WRONG_SOURCE = DEFAULT_SOURCE.replace(MEAN, "acc_BD = acc_BD * 2 / tl.maximum")
REJECTED_SOURCE = DEFAULT_SOURCE.replace("import torch\n", "import os\nimport torch\n", 1)
# Reaches for torch's own embedding_bag: the op computed outside a Triton kernel.
FALLBACK_SOURCE = DEFAULT_SOURCE + "\nFALLBACK = torch.nn.functional.embedding_bag\n"
FIRST_MEAN_SHAPE = next(s for s in CHECK_SHAPES if s.params.get("mode") == "mean")


def _candidate(source: str) -> Candidate:
    return Candidate(problem="embedding_bag", source=source, entry=TEMPLATE.entry, origin="human")


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    import ray

    # "local" always starts a new cluster, whatever RAY_ADDRESS or an earlier cluster says.
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ray-scratch")


@pytest.fixture(scope="module")
def backend(cluster: None, scratch: Path) -> RayBackend:
    # The cluster is up already: the backend joins it rather than starting its own.
    return RayBackend(timeout_s=120, scratch_root=scratch)


def test_importing_the_backend_leaves_ray_unimported() -> None:
    # `sandbox` must stay light: the judge and its runner run on hosts that need no Ray.
    code = "import sys, sandbox, sandbox.ray_backend; assert 'ray' not in sys.modules, 'ray was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_source_edits_still_apply() -> None:
    assert DEFAULT_SOURCE.count(MEAN) == 1, f"template changed: {MEAN!r} no longer appears once"
    assert REJECTED_SOURCE != DEFAULT_SOURCE


@pytest.fixture(scope="module")
def batch(backend: RayBackend, scratch: Path) -> tuple[list[Candidate], list[EvalResult], list[EvalResult]]:
    """A correct, a wrong and a rejected candidate, as one batch on the cluster and one after
    another on the local backend: (candidates, Ray's results, the local backend's results)."""
    candidates = [_candidate(s) for s in (DEFAULT_SOURCE, WRONG_SOURCE, REJECTED_SOURCE)]
    local = LocalBackend(timeout_s=120, scratch_root=scratch)
    # The local backend runs beside the cluster: once the short wrong candidate is done, one
    # of the two cores the cluster was given would otherwise sit idle.
    with ThreadPoolExecutor(max_workers=1) as pool:
        local_future = pool.submit(lambda: [local.evaluate(c, timing=False, trials=1) for c in candidates])
        on_ray = backend.evaluate_many(candidates, timing=False, trials=1)
        on_local = local_future.result()
    return candidates, on_ray, on_local


def test_wrong_candidate_names_the_shape(batch) -> None:
    _, (_, result, _), _ = batch
    assert result.status == Status.WRONG, f"{result.message}\n{result.log_tail}"
    assert result.message.startswith(FIRST_MEAN_SHAPE.describe())
    assert "outside tolerance" in result.message
    assert result.timings == []


def test_a_batch_gets_the_local_statuses_in_order(backend: RayBackend, scratch: Path, batch) -> None:
    candidates, on_ray, on_local = batch
    expected = [Status.OK, Status.WRONG, Status.STATIC_REJECTED]
    assert [r.status for r in on_ray] == expected, [f"{r.message}\n{r.log_tail}" for r in on_ray]
    assert [r.status for r in on_local] == expected, [f"{r.message}\n{r.log_tail}" for r in on_local]
    assert [r.candidate_id for r in on_ray] == [c.id for c in candidates]

    ok = on_ray[0]
    # Trial 0 of each shape, in order: two calls on the same inputs, each checked.
    assert [(c.shape, c.dtype) for c in ok.checks if c.trial == 0] == [
        (s.name, s.dtype) for s in CHECK_SHAPES for _ in range(2)
    ]
    assert all(c.ok for c in ok.checks), [c for c in ok.checks if not c.ok]
    # One GPU per task where the cluster has GPUs; the interpreter on a CPU-only cluster.
    assert backend.use_gpus == torch.cuda.is_available()
    assert ok.device is not None and ok.device.interpreted == (not backend.use_gpus)
    for result in (on_ray[1], on_local[1]):
        assert result.message.startswith(FIRST_MEAN_SHAPE.describe())
    assert on_ray[2] == on_local[2], (on_ray[2].message, on_local[2].message)
    assert list(scratch.iterdir()) == []  # each host removed its scratch directories


@pytest.mark.parametrize(
    ("problem", "source", "rule"),
    [
        ("embedding_bag", REJECTED_SOURCE, "import of 'os'"),
        ("embedding_bag", FALLBACK_SOURCE, "rule 'fallback'"),
        ("no_such_problem", DEFAULT_SOURCE, "unknown problem 'no_such_problem'"),
    ],
    ids=["forbidden-import", "torch-fallback", "unknown-problem"],
)
def test_rejection_is_the_local_one_and_schedules_no_task(
    backend: RayBackend, monkeypatch: pytest.MonkeyPatch, problem: str, source: str, rule: str
) -> None:
    candidate = Candidate(problem=problem, source=source, entry=TEMPLATE.entry, origin="human")
    monkeypatch.setattr(backend, "_task", None)  # any submission would raise AttributeError
    result = backend.evaluate(candidate)
    assert result.status == Status.STATIC_REJECTED
    assert rule in result.message
    # Word for word what the local backend says (it, too, rejects before starting a worker).
    local = LocalBackend().evaluate(candidate)
    assert result == local, (result.message, local.message)


def test_dead_task_is_a_runtime_error(backend: RayBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def die(*args: object) -> str:
        os._exit(1)  # the Ray worker process itself, as a segfault or the OOM killer would end it

    monkeypatch.setattr(backend, "_task", ray.remote(die))
    dead, rejected = _candidate(DEFAULT_SOURCE), _candidate(REJECTED_SOURCE)
    results = backend.evaluate_many([dead, rejected])
    assert [r.status for r in results] == [Status.RUNTIME_ERROR, Status.STATIC_REJECTED]
    assert results[0].candidate_id == dead.id
    assert results[0].message.startswith("ray task died without a result (WorkerCrashedError:")
    assert results[0].log_tail
