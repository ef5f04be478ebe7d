"""Campaigns that plan from the model.

A campaign with a [model] section profiles the model's step once, when it starts
(model.profile: time per kernel-library op and shape bucket, with each one's roofline
fraction). Its plan then gives the next turn to the problem with the most expected gain left:

    gain(problem) = sum over its op's profile rows of (time in the step) x (1 - roofline fraction)

(the whole time where the fraction is unknown, as on a CPU), shared out over the turns the
problem has had: gain / (1 + evaluations / batch size). The choice and its reason go to the
progress display and into the report.

Where the campaign names no problems, they are the problems of the ops the step calls (forward
ops and the gradient ops their backward dispatches), most gain first, and where the campaign
proposes by knob search only, those with a knob template.

At the end the campaign measures the model's step with the library as it was when the
campaign started (a copy kept beside the report) and as it is now, side by side in one process,
alternating step by step: the model-level speedup of the night.

Files, under the campaign's report folder: model/profile.json, model/library-at-start/,
model/step.json.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import CampaignConfig, ModelSection
from sandbox.result import ratio

MODEL_DIR = "model"
PROFILE_FILE = "profile.json"
STEP_FILE = "step.json"
LIBRARY_AT_START = "library-at-start"


def model_dir(report_dir: str | Path) -> Path:
    return Path(report_dir) / MODEL_DIR


def _device(section: ModelSection):
    import torch

    return torch.device(section.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def profile_for(section: ModelSection, library: Path) -> dict[str, Any]:
    """The profile of the section's step (model.profile.Profile.to_dict), dispatching through
    `library`."""
    from kernels import DISPATCHER
    from model.config import load_config
    from model.profile import profile_model

    with DISPATCHER.library_at(library):
        profile = profile_model(
            load_config(section.config),
            section.graph,
            _device(section),
            steps=section.profile_steps,
            warmup=1,
        )
    return profile.to_dict()


def prepare(config: CampaignConfig, report_dir: Path, library: Path) -> CampaignConfig:
    """At a campaign's start: profile the model, keep a copy of the library as it is, and name
    the problems where the config names none. Returns the config to run (and store)."""
    assert config.model is not None
    out = model_dir(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    snapshot = out / LIBRARY_AT_START
    if snapshot.exists():
        shutil.rmtree(snapshot)
    if library.is_dir():
        shutil.copytree(library, snapshot)
    else:
        snapshot.mkdir()
    profile = profile_for(config.model, library)
    (out / PROFILE_FILE).write_text(json.dumps(profile, indent=2) + "\n")
    if config.problems:
        return config
    problems = problems_from_profile(profile, searchable_only=config.proposer.kinds == ["search"])
    if not problems:
        ops = sorted({r["op"] for r in profile["rows"]})
        raise ValueError(
            f"the model's {config.model.graph} step calls no op with a problem to work on (its ops: {ops}); "
            "name the problems in the config"
        )
    data = config.model_dump()
    data["problems"] = problems
    return CampaignConfig.model_validate(data)


def problems_from_profile(profile: dict[str, Any], *, searchable_only: bool) -> list[str]:
    """The problems of the profiled ops, most expected gain first."""
    from search_space import get_problem, problem_names

    known = set(problem_names())
    gains = expected_gains(profile)
    chosen = [p for p in sorted(gains, key=lambda p: -gains[p].gain_ms) if p in known]
    if searchable_only:
        chosen = [p for p in chosen if get_problem(p).template is not None]
    return chosen


@dataclass(frozen=True)
class Gain:
    problem: str
    ms: float  # the op's time per step
    gain_ms: float  # what reaching its roofline would save per step
    fraction: float | None  # time-weighted roofline fraction, where known
    step_ms: float
    graph: str
    # The (dtype, shape bucket) pairs the model's calls of the op fall in.
    calls: tuple[tuple[str, str], ...] = ()

    @property
    def buckets(self) -> list[str]:
        return [f"{dtype} {bucket}" for dtype, bucket in self.calls]

    def reason(self, evaluations: int) -> str:
        at = "roofline unknown" if self.fraction is None else f"at {self.fraction:.0%} of its roofline"
        return (
            f"{self.problem}: {self.ms:.3f} ms of the {self.step_ms:.3f} ms {self.graph} step ({at}), "
            f"{self.gain_ms:.3f} ms to gain; {evaluations} evaluated so far"
        )


def expected_gains(profile: dict[str, Any]) -> dict[str, Gain]:
    """Per op of the profile (named as its problem), its time, fraction and expected gain."""
    by_op: dict[str, list[dict]] = {}
    for row in profile["rows"]:
        if row["implementations"]:  # the rest of the step ("torch ...") is no op's
            by_op.setdefault(row["op"], []).append(row)
    gains = {}
    for op, rows in by_op.items():
        ms = sum(r["ms"] for r in rows)
        known = [r for r in rows if r["fraction"] is not None]
        fraction = (
            sum(r["fraction"] * r["ms"] for r in known) / ms
            if known and len(known) == len(rows) and ms
            else None
        )
        gains[op] = Gain(
            problem=op,
            ms=ms,
            gain_ms=sum(r["gain_ms"] for r in rows),
            fraction=fraction,
            step_ms=profile["step_ms"],
            graph=profile["graph"],
            calls=tuple(sorted({(r["dtype"], r["bucket"]) for r in rows})),
        )
    return gains


def untimed_buckets(problem: str, calls: tuple[tuple[str, str], ...], *, interpreted: bool) -> list[str]:
    """The model's (dtype, bucket) pairs of `problem` that none of the shapes a campaign times
    it on falls in (its interpreted timing shapes on the interpreter): a winner says nothing of
    them, and dispatch keeps what it ran there."""
    from search_space import get_problem

    spec = get_problem(problem)
    shapes = spec.interpreted_timing_shapes if interpreted else spec.timing_shapes
    timed = {(str(s.torch_dtype).removeprefix("torch."), spec.bucket(s)) for s in shapes}
    return [f"{dtype} {bucket}" for dtype, bucket in calls if (dtype, bucket) not in timed]


class ModelPlan:
    """The plan of a campaign with a model: its profile's gains over its problems."""

    def __init__(self, profile: dict[str, Any], problems: list[str]) -> None:
        self.profile = profile
        gains = expected_gains(profile)
        step = profile["step_ms"]
        self.gains = {p: gains.get(p) or Gain(p, 0.0, 0.0, None, step, profile["graph"]) for p in problems}

    @classmethod
    def load(cls, report_dir: str | Path, problems: list[str]) -> ModelPlan | None:
        path = model_dir(report_dir) / PROFILE_FILE
        if not path.exists():
            return None
        return cls(json.loads(path.read_text()), problems)

    def choose(self, evaluations: dict[str, int], batch_size: int) -> tuple[str, str]:
        """(the problem with the most expected gain left, why). Ties (no gain anywhere) go to
        the one with the fewest evaluations."""

        def left(problem: str) -> tuple[float, int]:
            turns = evaluations.get(problem, 0) / max(1, batch_size)
            return (self.gains[problem].gain_ms / (1.0 + turns), -evaluations.get(problem, 0))

        problem = max(self.gains, key=left)
        return problem, self.gains[problem].reason(evaluations.get(problem, 0))


def measure_step(
    section: ModelSection, libraries: dict[str, Path], *, rounds: int | None = None
) -> dict[str, Any]:
    """The model's step time with each library, measured in this process side by side: the
    same model, one warm-up step each, then `rounds` rounds of one step per library in turn (so
    drift hits all alike); per library the median step. Every step, the warm-up's too, runs on a
    batch that no library's step has seen (two libraries may hold the same kernel), all of them
    variants of one batch (model.profile.ModelStep): the same sizes, so that the warm-up compiles
    what the timed steps run, and the same work for every library."""
    import statistics
    from functools import partial

    import torch

    from kernels import DISPATCHER
    from kernels.registry import KernelLibrary
    from model.config import load_config
    from model.profile import ModelStep
    from model.serving import timed

    config = load_config(section.config)
    device = _device(section)
    rounds = rounds or section.measure_steps
    step = ModelStep(config, section.graph, device, batches=1)

    times: dict[str, list[float]] = {label: [] for label in libraries}
    implementations: dict[str, dict[str, str]] = {}
    # One library object each, so that a round's switch loads nothing again.
    loaded = {label: KernelLibrary(path) for label, path in libraries.items()}
    for label, library in loaded.items():  # warm-up: compiles and loads each library's kernels
        with DISPATCHER.library_at(library):
            DISPATCHER.last.clear()
            step.run(step.batch(0))
            implementations[label] = dict(DISPATCHER.last)
    # Every timed step's batch made on the device before the first clock starts: no host work
    # between timed steps.
    batches = [[step.batch(0) for _ in loaded] for _ in range(rounds)]
    for round_batches in batches:
        for (label, library), batch in zip(loaded.items(), round_batches, strict=True):
            with DISPATCHER.library_at(library):
                times[label].append(timed(partial(step.run, batch), device))
    del batches, round_batches, batch
    medians = {label: 1e3 * statistics.median(ts) for label, ts in times.items()}
    return {
        "graph": section.graph,
        "config": config.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "rounds": rounds,
        "step_ms": medians,
        "implementations": implementations,
    }


def measure_at_end(config: CampaignConfig, report_dir: Path, library: Path) -> dict[str, Any] | None:
    """The model's step with the library at the start and now (model/step.json), or None for a
    campaign without a model."""
    if config.model is None:
        return None
    out = model_dir(report_dir)
    snapshot = out / LIBRARY_AT_START
    if not snapshot.is_dir():
        return None
    result = measure_step(config.model, {"start": snapshot, "end": library})
    start, end = result["step_ms"]["start"], result["step_ms"]["end"]
    result["speedup"] = start / end if end else None
    (out / STEP_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result


def measure_change(config: CampaignConfig, report_dir: Path, library: Path, kernel_id: str) -> dict | None:
    """For a campaign with a model: its step with the library as the campaign found it and as it
    is now that kernel `kernel_id` is registered (with every kernel the campaign registered
    before it), measured side by side, with a summary line for the change's description; None
    without a model, and the failure's text if the model cannot be measured."""
    snapshot = model_dir(report_dir) / LIBRARY_AT_START
    if config.model is None or not snapshot.is_dir():
        return None
    try:
        measured = measure_step(config.model, {"start": snapshot, "now": library})
    except Exception as exc:  # the model's failure: the change opens without its figure
        return {"error": f"{type(exc).__name__}: {exc}", "summary": f"Model step: not measured ({exc})."}
    start, now = measured["step_ms"]["start"], measured["step_ms"]["now"]
    speedup = ratio(start / now) if now else "n/a"
    measured["summary"] = (
        f"Model step ({measured['config']} {measured['graph']}, {measured['device']}, median of "
        f"{measured['rounds']} side by side): {start:.3f} ms with the library as the campaign found it, "
        f"{now:.3f} ms with the library as it is with this kernel ({kernel_id}) and those the "
        f"campaign registered before it: {speedup}."
    )
    return measured


def measure_model(config: CampaignConfig, report_dir: Path, library: Path) -> dict[str, Any] | None:
    """measure_at_end, its failure recorded in model/step.json (the report says why) rather
    than raised: the campaign's kernels are registered already, and its report must follow."""
    try:
        return measure_at_end(config, report_dir, library)
    except Exception as exc:  # the model's failure, not the campaign's
        out = model_dir(report_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / STEP_FILE).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return None


def load_step(report_dir: str | Path) -> dict[str, Any] | None:
    path = model_dir(report_dir) / STEP_FILE
    return json.loads(path.read_text()) if path.exists() else None
