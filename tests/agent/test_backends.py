"""The backend is a config choice: one campaign, run on the local, Docker and Ray backends,
evaluates the same candidates with the same statuses."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from agent.campaign import Campaigns
from agent.config import load_config

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, backend: str) -> dict[str, str]:
    cfg = tmp_path / f"{backend}.toml"
    cfg.write_text(
        textwrap.dedent(f"""
        name = "{backend}"
        problems = ["embedding_bag"]
        output_dir = "{tmp_path / backend / "out"}"
        library = "{tmp_path / backend / "library"}"
        register_kernels = false
        [proposer]
        batch_size = 3
        seed = 11
        [budget]
        max_evaluations = 3
        max_wall_s = 600
        [sandbox]
        backend = "{backend}"
        ray_address = "local"
        timeout_s = 120
    """)
    )
    campaigns = Campaigns(tmp_path / backend / "home")
    outcome = campaigns.start(load_config(cfg))
    return {r.candidate.id: r.result.status.value for r in campaigns.store.evaluations(outcome.campaign_id)}


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The campaign on the local backend, run once for every comparison."""
    statuses = _run(tmp_path_factory.mktemp("local"), "local")
    assert len(statuses) == 3
    return statuses


def test_local_and_ray_campaigns_agree(tmp_path: Path, local: dict[str, str]) -> None:
    import ray

    try:
        on_ray = _run(tmp_path, "ray")
    finally:
        ray.shutdown()
    assert on_ray == local


@pytest.mark.docker
def test_local_and_docker_campaigns_agree(tmp_path: Path, local: dict[str, str]) -> None:
    from sandbox.docker_image import DockerUnavailable, docker_client

    try:
        docker_client()
    except DockerUnavailable as exc:
        pytest.skip(str(exc))
    assert _run(tmp_path, "docker") == local
