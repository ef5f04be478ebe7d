"""Campaigns end to end on real workers: one run in a child process, SIGKILLed mid-run, resumed
and finished; and the backend as a config choice: one campaign, run on the local, Docker and Ray
backends, evaluates the same candidates with the same statuses.

A campaign evaluates its candidates one after another, each in a worker that keeps one core busy
for seconds: so the campaigns of this module run side by side, each once, and together keep both
cores of a small CI machine busy instead of one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from agent.campaign import CampaignError, Campaigns
from agent.config import load_config
from agent.store import Store
from kernels.registry import KernelLibrary
from sandbox.result import Status

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, max_evaluations: int) -> Path:
    path = tmp_path / "campaign.toml"
    path.write_text(
        textwrap.dedent(f"""
        name = "t"
        problems = ["embedding_bag"]
        output_dir = "{tmp_path / "out"}"
        library = "{tmp_path / "library"}"
        [proposer]
        batch_size = 2
        seed = 3
        [proposer.space.embedding_bag]  # wide tiles: the interpreter runs them in seconds
        BLOCK_B = [4, 8]
        BLOCK_L = [8, 16]
        BLOCK_D = [128, 256]
        [budget]
        max_evaluations = {max_evaluations}
        max_wall_s = 600
        [sandbox]
        timeout_s = 300  # four campaigns share a small machine's two cores
        trials = 2
    """)
    )
    return path


def _kill_then_resume(tmp_path: Path) -> None:
    """The campaign run by the CLI in a child process, SIGKILLed after its first evaluation,
    then resumed here to its end; asserts as it goes."""
    home = tmp_path / "home"
    # A relative home, as users give it: workers run elsewhere and must still find their files.
    env = {**os.environ, "RECFORGE_HOME": "home", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "campaign", "run", str(_config(tmp_path, 3))],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if (home / "store.db").exists():
                campaigns = Store(home / "store.db").campaigns()
                if campaigns and Store(home / "store.db").count_evaluations(campaigns[0].id) >= 1:
                    break
        else:
            pytest.fail("the campaign evaluated nothing within 120 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no clean shutdown: the worst case for resume
        proc.wait()

    campaigns = Campaigns(home)
    [row] = campaigns.store.campaigns()
    done_before = campaigns.store.count_evaluations(row.id)
    assert 1 <= done_before < 3
    assert row.status == "running"  # it never got to say otherwise

    outcome = campaigns.resume(row.id)

    rows = campaigns.store.evaluations(row.id)
    ids = [r.candidate.id for r in rows]
    assert len(ids) == 3 and len(set(ids)) == 3, "evaluations were lost or repeated"
    assert [r.result.status for r in rows] == [Status.OK] * 3, [r.result.message for r in rows]
    assert outcome.stop_reason.startswith("evaluation budget reached")
    assert outcome.best["embedding_bag"] in ids
    assert rows[0].candidate.origin == "library"  # what dispatch runs today is measured first
    # On the interpreter timings decide nothing, so the first correct proposal (not the noise's
    # winner) is registered (labelled interpreted), after re-verification, with its evidence and
    # lineage.
    [entry] = KernelLibrary(tmp_path / "library").entries()
    proposals = [r for r in rows if r.score_us is not None and r.candidate.origin != "library"]
    assert entry.source_hash == min(proposals, key=lambda r: r.seq).candidate.id
    assert entry.provenance["campaign"] == row.id
    assert entry.evidence["reverification"]["status"] == "ok"
    assert entry.interpreted == (entry.arch == "interpreter")
    assert outcome.report.read_text().count("| ok |") >= 1
    assert campaigns.store.campaign(row.id).status == "finished"
    with pytest.raises(CampaignError, match="already finished"):
        campaigns.resume(row.id)
    assert campaigns.store.campaign(row.id).status == "finished"  # a refused resume changes nothing


def _on_backend(tmp_path: Path, backend: str) -> dict[str, str]:
    """The backend-agreement campaign on `backend`: its candidates' statuses by id. Its two
    candidates are proposed in one batch, before any timing could steer the search."""
    cfg = tmp_path / f"{backend}.toml"
    cfg.write_text(
        textwrap.dedent(f"""
        name = "{backend}"
        problems = ["embedding_bag"]
        output_dir = "{tmp_path / backend / "out"}"
        library = "{tmp_path / backend / "library"}"
        register_kernels = false
        [proposer]
        batch_size = 2
        seed = 11
        [proposer.space.embedding_bag]  # wide tiles: the interpreter runs them in seconds
        BLOCK_B = [4, 8]
        BLOCK_L = [8, 16]
        BLOCK_D = [128, 256]
        [budget]
        max_evaluations = 2
        max_wall_s = 600
        [sandbox]
        backend = "{backend}"
        ray_address = "local"
        timeout_s = 300  # four campaigns share a small machine's two cores
    """)
    )
    campaigns = Campaigns(tmp_path / backend / "home")
    outcome = campaigns.start(load_config(cfg))
    return {r.candidate.id: r.result.status.value for r in campaigns.store.evaluations(outcome.campaign_id)}


def _on_ray(tmp_path: Path) -> dict[str, str]:
    import ray

    try:
        return _on_backend(tmp_path, "ray")
    finally:
        ray.shutdown()


def _docker_reachable() -> bool:
    from sandbox.docker_image import DockerUnavailable, docker_client

    try:
        docker_client()
    except DockerUnavailable:
        return False
    return True


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """Every campaign the selected tests of this module need, run side by side: name -> its
    run (a failed run raises in the tests that ask for it)."""
    selected = {item.originalname for item in request.session.items if item.path == request.path}
    work: dict[str, Callable[[Path], object]] = {}
    if "test_killed_campaign_resumes_and_finishes" in selected:
        work["killed"] = _kill_then_resume
    if selected & {"test_local_and_ray_campaigns_agree", "test_local_and_docker_campaigns_agree"}:
        work["local"] = lambda tmp: _on_backend(tmp, "local")
    if "test_local_and_docker_campaigns_agree" in selected and _docker_reachable():
        work["docker"] = lambda tmp: _on_backend(tmp, "docker")
    started: dict[str, Future] = {}
    with ThreadPoolExecutor(max_workers=max(1, len(work))) as pool:
        for name, fn in work.items():
            started[name] = pool.submit(fn, tmp_path_factory.mktemp(name))
        if "test_local_and_ray_campaigns_agree" in selected:
            # Ray in this thread, the one that started the test session, as a Ray driver expects.
            started["ray"] = Future()
            try:
                started["ray"].set_result(_on_ray(tmp_path_factory.mktemp("ray")))
            except Exception as exc:
                started["ray"].set_exception(exc)
    return started


def test_killed_campaign_resumes_and_finishes(runs: dict[str, Future]) -> None:
    runs["killed"].result()  # the assertions are in _kill_then_resume


@pytest.fixture(scope="module")
def local(runs: dict[str, Future]) -> dict[str, str]:
    """The campaign on the local backend, the one every other backend is compared with."""
    statuses = runs["local"].result()
    assert len(statuses) == 2
    return statuses


def test_local_and_ray_campaigns_agree(runs: dict[str, Future], local: dict[str, str]) -> None:
    assert runs["ray"].result() == local


@pytest.mark.docker
def test_local_and_docker_campaigns_agree(runs: dict[str, Future], local: dict[str, str]) -> None:
    from sandbox.docker_image import DockerUnavailable, docker_client

    try:
        docker_client()
    except DockerUnavailable as exc:
        pytest.skip(str(exc))
    assert runs["docker"].result() == local
