"""Campaign configuration: a TOML file validated into typed models.

Errors name the file and the offending field, e.g.
`campaigns/x.toml: budget.max_evaluations: Input should be greater than or equal to 1`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from search_space import get_problem, problem_names
from search_space.template import get_template


class ConfigError(ValueError):
    """A campaign config that cannot be used; the message names the file and field."""


class LLMConfigError(ConfigError):
    """The LLM endpoint cannot be used as configured (e.g. its API key variable is not set)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


ProposerKind = Literal["llm", "search"]


class ProposerConfig(_Strict):
    kinds: list[ProposerKind] = Field(
        default_factory=lambda: ["search"],
        min_length=1,
        description="proposers per problem, in the order they fill a batch: a proposer that returns "
        "fewer candidates than its share leaves the rest to the ones after it",
    )
    shares: dict[ProposerKind, float] = Field(
        default_factory=dict,
        description="relative share of each batch per kind (default: equal); e.g. llm = 1, search = 3",
    )
    sampler: Literal["tpe", "random"] = "tpe"
    batch_size: int = Field(4, ge=1, le=64, description="candidates proposed per iteration")
    elites: int = Field(
        4,
        ge=1,
        le=64,
        description="diverse elites kept per problem (correct candidates, at most one per lineage): "
        "the LLM improves them in turn, the search starts from them when the best's knobs are exhausted",
    )
    seed: int = 0
    space: dict[str, dict[str, list[Any]]] = Field(
        default_factory=dict,
        description="the knob values the search may choose, per problem, e.g. "
        "space.embedding_bag.BLOCK_D = [64, 128]; a knob not named keeps all its choices",
    )

    @model_validator(mode="before")
    @classmethod
    def _single_kind(cls, data):
        # `kind = "search"` is how configs (and the stored configs of older campaigns) name one.
        if isinstance(data, dict) and "kind" in data:
            data = dict(data)
            kind = data.pop("kind")
            data.setdefault("kinds", [kind])
        return data

    @model_validator(mode="after")
    def _shares_of_kinds(self) -> ProposerConfig:
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds {self.kinds} name a proposer twice")
        stray = sorted(set(self.shares) - set(self.kinds))
        if stray:
            raise ValueError(f"shares given for {stray}, which are not among kinds {self.kinds}")
        if any(v <= 0 for v in self.shares.values()):
            raise ValueError("every share must be greater than 0 (leave a kind out of kinds instead)")
        return self

    def share(self, kind: str) -> float:
        """Fraction of a batch that `kind` is asked for."""
        weights = {k: self.shares.get(k, 1.0) for k in self.kinds}
        return weights[kind] / sum(weights.values())


class LLMConfig(_Strict):
    """An OpenAI-compatible chat endpoint (a hosted API, vLLM, SGLang, Ollama) and how to use it.

    The API key is read from the environment variable `api_key_env` when the client is built;
    it is never part of the config, the store or any log."""

    base_url: str = Field(..., min_length=1, description="e.g. http://localhost:8000/v1")
    model: str = Field(..., min_length=1)
    api_key_env: str | None = Field(
        "OPENAI_API_KEY",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable holding the API key (None: the endpoint needs none)",
    )
    temperature: float = Field(0.7, ge=0, le=2)
    max_tokens: int = Field(8192, ge=64, description="completion tokens per request")
    timeout_s: float = Field(300.0, gt=0, description="per HTTP request")
    max_retries: int = Field(
        4, ge=0, le=20, description="retries of a request that timed out, got 429 or 5xx, or garbage"
    )
    backoff_initial_s: float = Field(2.0, gt=0, description="first retry delay; doubles per retry")
    backoff_max_s: float = Field(60.0, gt=0)
    retry_after_max_s: float = Field(300.0, gt=0, description="longest Retry-After honoured")
    structured_output: Literal["json_schema", "json_object", "tools", "none", "auto"] = Field(
        "json_schema",
        description="how replies are constrained: response_format json_schema or json_object, "
        "tools (a propose_kernel tool the model must call, for servers whose tool calling is "
        "better than their response_format), none (plain JSON instructions), or auto (the "
        "pre-flight tries json_schema, then tools, else none); replies are validated either way, "
        "and a server that refuses the constraint gets requests without it",
    )
    format_retries: int = Field(
        2, ge=0, le=10, description="re-asks, with the validation error, after an unusable reply"
    )
    repair_depth: int = Field(
        2, ge=0, le=10, description="times a failed kernel goes back to the model with its error"
    )
    history: int = Field(6, ge=0, le=50, description="recent attempts of the lineage shown in a prompt")
    outage_failures: int = Field(
        3, ge=1, description="consecutive failed requests (after retries) that pause the LLM proposer"
    )
    outage_cooldown_s: float = Field(900.0, gt=0, description="pause before the LLM is tried again")
    max_empty_rounds: int = Field(
        3, ge=1, description="consecutive rounds without a usable proposal before the LLM proposer gives up"
    )
    cost_per_million_input_tokens: float = Field(0.0, ge=0, description="price of prompt tokens")
    cost_per_million_output_tokens: float = Field(0.0, ge=0, description="price of completion tokens")

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * self.cost_per_million_input_tokens
            + completion_tokens * self.cost_per_million_output_tokens
        ) / 1e6


@dataclass(frozen=True)
class BudgetSpent:
    """What a campaign has used of its budgets, summed from the store (so it survives a resume)."""

    evaluations: int
    wall_s: float
    gpu_s: float  # see BudgetConfig.max_gpu_s
    llm_tokens: int = 0
    llm_cost: float = 0.0


class BudgetConfig(_Strict):
    """The campaign stops cleanly at the first budget reached and says which."""

    max_evaluations: int = Field(..., ge=1)
    max_wall_s: float = Field(..., gt=0)
    max_gpu_s: float | None = Field(
        None,
        gt=0,
        description="device seconds of the evaluations: the sum of each one's check and timing phases "
        "(the phases that run kernels; not the worker's start-up, the import or the wait for the timing "
        "lock), on the interpreter the CPU's; parallel workers' checks add up like CPU-seconds",
    )
    max_llm_tokens: int | None = Field(None, ge=1, description="prompt plus completion tokens")
    max_llm_cost: float | None = Field(
        None, gt=0, description="money spent on the LLM, in the unit of llm.cost_per_million_*"
    )

    def reached(self, spent: BudgetSpent) -> str | None:
        """The first budget that `spent` uses up, in words, or None."""
        if spent.evaluations >= self.max_evaluations:
            return f"evaluation budget reached ({spent.evaluations} of {self.max_evaluations})"
        if spent.wall_s >= self.max_wall_s:
            return f"wall-time budget reached ({spent.wall_s:.0f} s of {self.max_wall_s:.0f} s)"
        if self.max_gpu_s is not None and spent.gpu_s >= self.max_gpu_s:
            return f"GPU-seconds budget reached ({spent.gpu_s:.1f} s of {self.max_gpu_s:.1f} s)"
        return self.llm_reached(spent.llm_tokens, spent.llm_cost)

    def llm_reached(self, tokens: int, cost: float) -> str | None:
        """The LLM budget that `tokens` and `cost` use up, in words, or None."""
        if self.max_llm_tokens is not None and tokens >= self.max_llm_tokens:
            return f"LLM token budget reached ({tokens} of {self.max_llm_tokens} tokens)"
        if self.max_llm_cost is not None and cost >= self.max_llm_cost:
            return f"LLM money budget reached ({cost:.4f} of {self.max_llm_cost:.4f})"
        return None


class SandboxConfig(_Strict):
    backend: Literal["local", "docker", "ray"] = Field(
        "local",
        description="local: worker processes on this host; docker: each worker in a locked-down "
        "container; ray: tasks on a Ray cluster, one GPU each where there are GPUs",
    )
    parallel_workers: int = Field(
        1,
        ge=1,
        le=16,
        description="local backend: workers at once on each GPU of `gpus` (without it, on the host); "
        "they take turns only for timing",
    )
    gpus: Literal["all"] | StrictInt | list[StrictInt] | None = Field(
        None,
        description='local backend: the GPUs to evaluate on, each with a timing worker of its own: "all", '
        "the first N, or a list of indices as torch numbers them (within CUDA_VISIBLE_DEVICES); each "
        "evaluation's judge sees only its GPU, and a candidate goes to whichever GPU frees first. Unset: "
        "the visible GPUs as one, whose evaluations take turns for timing. On a host without a GPU, "
        '"all" changes nothing',
    )
    ray_address: str | None = Field(None, description="Ray cluster address (None: RAY_ADDRESS or local)")
    docker_mem_limit: str = Field("8g", description="memory limit of each container")
    docker_cpus: float = Field(1.0, gt=0, description="CPUs of each container")
    docker_image: str | None = Field(
        None,
        description="image the docker backend runs workers in (None: one built offline from host "
        "files, without a C compiler, so CPU hosts only); it must hold this interpreter's path",
    )
    isolation: Literal["bwrap", "none"] = Field(
        "bwrap",
        description="local and ray backends: how the runner that imports a candidate is isolated; "
        "bwrap (user, PID, mount and network namespaces, read-only files, as an unprivileged "
        "user) or none (a plain process: only for hosts without user namespaces, and no defence "
        "against a hostile candidate)",
    )
    timeout_s: float = Field(300.0, gt=0, description="hard wall-clock limit per evaluation")
    trials: int = Field(2, ge=2, le=10, description="correctness trials per check shape, fresh inputs each")
    baselines: list[str] | None = Field(
        None,
        description="timed once per problem on each kind of device that evaluates its candidates "
        "(default: all of the problem's; reference.compile is skipped when timings are interpreted)",
    )

    @field_validator("gpus", mode="before")
    @classmethod
    def _some_gpus(cls, value):
        # What no host takes, in one sentence; sandbox.gpus.select_gpus checks the rest against
        # the host's GPUs when the campaign starts.
        from sandbox.gpus import check_gpus

        check_gpus(value)
        return value

    @model_validator(mode="after")
    def _gpus_of_the_local_backend(self) -> SandboxConfig:
        if self.gpus is not None and self.backend != "local":
            how = "gives each task one GPU of its own" if self.backend == "ray" else "has no per-GPU workers"
            raise ValueError(f"gpus applies to the local backend; the {self.backend} backend {how}")
        return self


class ReviewConfig(_Strict):
    changes: bool | None = Field(
        None,
        description="open a kernel change (a git branch with the kernel, its test and evidence; see "
        "`recforge review`) for each kernel the campaign registers; default: on a GPU, not on the "
        "interpreter",
    )
    repo: Path | None = Field(None, description="the git repository of the changes; default: this checkout")
    pull_requests: bool | None = Field(
        None,
        description="also push each change and open a pull request with its description through `gh`; "
        "default: where changes are opened and `gh` is installed and authenticated",
    )
    remote: str = Field("origin", min_length=1, description="the git remote that pull requests push to")


class ModelSection(_Strict):
    """The model a campaign works for: its plan profiles the model's step once and chooses the
    problem with the most to gain; its report measures the model's step with the library as it
    was at the start and as it is at the end."""

    config: str = Field(..., description="model config TOML file, or a preset: tiny, small, large")
    graph: Literal["train", "serve"] = Field("train", description="the step the campaign speeds up")
    device: str | None = Field(
        None, description="where to profile: cuda, cpu (default: cuda where there is one)"
    )
    profile_steps: int = Field(2, ge=1, description="steps the profile times (after one warm-up step)")
    measure_steps: int = Field(3, ge=1, description="steps per library in the report's before-and-after")

    @field_validator("config")
    @classmethod
    def _loads(cls, value: str) -> str:
        from model.config import load_config

        load_config(value)  # a ValueError naming what is wrong
        return value


class CampaignConfig(_Strict):
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    problems: list[str] = Field(
        default_factory=list,
        description="problems to work on; with a [model] section, by default those of the ops its step calls",
    )
    model: ModelSection | None = Field(None, description="plan from this model's profile")
    proposer: ProposerConfig = Field(default_factory=ProposerConfig)
    llm: LLMConfig | None = Field(None, description="the endpoint of the `llm` proposer")
    budget: BudgetConfig
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    output_dir: Path = Path("runs")
    library: Path | None = Field(None, description="kernel library folder; default: the package's")
    register_kernels: bool = Field(True, description="add each problem's re-verified best to the library")
    review: ReviewConfig = Field(default_factory=ReviewConfig)
    start_from: Literal["library", "reference"] = Field(
        "library",
        description="library: the first batch measures what dispatch runs today, the bar every proposal "
        "must clear; reference: proposals only, so the best speedup over time starts from the naive "
        "reference (needs register_kernels = false: nothing would show that a winner beats the library)",
    )

    @field_validator("problems")
    @classmethod
    def _known_problems(cls, value: list[str]) -> list[str]:
        unknown = [p for p in value if p not in problem_names()]
        if unknown:
            raise ValueError(f"unknown problem(s) {unknown}; known: {problem_names()}")
        return value

    @model_validator(mode="after")
    def _something_to_work_on(self) -> CampaignConfig:
        if not self.problems and self.model is None:
            raise ValueError("name the problems to work on, or a [model] whose profile chooses them")
        return self

    @model_validator(mode="after")
    def _proposers_can_work(self) -> CampaignConfig:
        if "llm" in self.proposer.kinds and self.llm is None:
            raise ValueError("proposer.kinds includes 'llm' but there is no [llm] section (base_url, model)")
        # The search proposer explores a template's knobs: a problem without one gives it nothing.
        untemplated = [p for p in self.problems if get_problem(p).template is None]
        if "search" in self.proposer.kinds and untemplated:
            searchable = [p for p in problem_names() if get_problem(p).template is not None]
            raise ValueError(
                f"problem(s) {untemplated} have no knob template for the search proposer; "
                f'searchable: {searchable} (an LLM-only campaign, proposer.kinds = ["llm"], takes any)'
            )
        for problem, allowed in self.proposer.space.items():
            if problem not in self.problems:
                raise ValueError(
                    f"proposer.space names {problem!r}, which is not among problems {self.problems}"
                )
            template = get_problem(problem).template
            if template is None:
                raise ValueError(f"proposer.space names {problem!r}, which has no knob template")
            try:
                get_template(problem).restricted(allowed)
            except ValueError as exc:
                raise ValueError(f"proposer.space.{problem}: {exc}") from None
        if self.start_from == "reference" and self.register_kernels:
            raise ValueError(
                'start_from = "reference" needs register_kernels = false: without the library\'s kernels '
                "measured in the campaign, nothing shows that a winner beats them"
            )
        return self


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
