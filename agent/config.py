"""Campaign configuration: a TOML file validated into typed models.

Errors name the file and the offending field, e.g.
`campaigns/x.toml: budget.max_evaluations: Input should be greater than or equal to 1`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from search_space import get_problem, problem_names


class ConfigError(ValueError):
    """A campaign config that cannot be used; the message names the file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProposerConfig(_Strict):
    kind: Literal["search"] = "search"
    sampler: Literal["tpe", "random"] = "tpe"
    batch_size: int = Field(4, ge=1, le=64, description="candidates proposed per iteration")
    seed: int = 0


class BudgetConfig(_Strict):
    max_evaluations: int = Field(..., ge=1)
    max_wall_s: float = Field(..., gt=0)


class SandboxConfig(_Strict):
    backend: Literal["local", "docker", "ray"] = Field(
        "local",
        description="local: worker processes on this host; docker: each worker in a locked-down "
        "container; ray: tasks on a Ray cluster, one GPU each where there are GPUs",
    )
    parallel_workers: int = Field(
        1, ge=1, le=16, description="local backend: workers at once; they take turns only for timing"
    )
    ray_address: str | None = Field(None, description="Ray cluster address (None: RAY_ADDRESS or local)")
    docker_mem_limit: str = Field("8g", description="memory limit of each container")
    docker_cpus: float = Field(1.0, gt=0, description="CPUs of each container")
    docker_image: str | None = Field(
        None,
        description="image the docker backend runs workers in (None: one built offline from host "
        "files, without a C compiler, so CPU hosts only); it must hold this interpreter's path",
    )
    timeout_s: float = Field(300.0, gt=0, description="hard wall-clock limit per evaluation")
    trials: int = Field(2, ge=2, le=10, description="correctness trials per check shape, fresh inputs each")
    baselines: list[str] | None = Field(
        None,
        description="timed once per problem on the campaign's device (default: all of the "
        "problem's; reference.compile is skipped when timings are interpreted)",
    )


class CampaignConfig(_Strict):
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    problems: list[str] = Field(..., min_length=1)
    proposer: ProposerConfig = Field(default_factory=ProposerConfig)
    budget: BudgetConfig
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    output_dir: Path = Path("runs")
    library: Path | None = Field(None, description="kernel library folder; default: the package's")
    register_kernels: bool = Field(True, description="add each problem's re-verified best to the library")

    @field_validator("problems")
    @classmethod
    def _known_problems(cls, value: list[str]) -> list[str]:
        unknown = [p for p in value if p not in problem_names()]
        if unknown:
            raise ValueError(f"unknown problem(s) {unknown}; known: {problem_names()}")
        # The search proposer explores a template's knobs: a problem without one gives it nothing.
        untemplated = [p for p in value if get_problem(p).template is None]
        if untemplated:
            searchable = [p for p in problem_names() if get_problem(p).template is not None]
            raise ValueError(
                f"problem(s) {untemplated} have no knob template for the search proposer; "
                f"searchable: {searchable}"
            )
        return value


def _field_path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def load_config(path: str | Path) -> CampaignConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_config(raw, source=str(path))


def parse_config(raw: dict, *, source: str = "config") -> CampaignConfig:
    try:
        return CampaignConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{source}: {_field_path(e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigError("\n".join(lines)) from None
