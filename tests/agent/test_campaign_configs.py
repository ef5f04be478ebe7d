"""Every campaign config shipped in campaigns/ is valid as it stands."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import load_config

CONFIGS = sorted((Path(__file__).parents[2] / "campaigns").glob("*.toml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"demo.toml", "attention-h200.toml", "llm-example.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads(path: Path) -> None:
    config = load_config(path)
    assert config.problems and config.budget.max_evaluations >= 1
