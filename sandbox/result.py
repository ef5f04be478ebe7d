"""Typed results that cross the worker's process boundary as JSON."""

from __future__ import annotations

from enum import StrEnum
from statistics import geometric_mean
from typing import Literal

from pydantic import BaseModel, Field


class Status(StrEnum):
    OK = "ok"
    STATIC_REJECTED = "static_rejected"
    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    WRONG = "wrong"
    SUSPICIOUS = "suspicious"


class ShapeCheck(BaseModel):
    """Outcome of comparing a candidate with the reference on one check shape and trial."""

    shape: str
    dtype: str
    trial: int
    ok: bool
    max_abs_err: float | None = None
    norm_rel_err: float | None = None
    worst_index: list[int] | None = None
    message: str = ""


class TimingStats(BaseModel):
    """Per-call times in microseconds over `reps` timed calls."""

    median_us: float
    p20_us: float
    p80_us: float
    reps: int

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: the relative noise of this measurement."""
        return (self.p80_us - self.p20_us) / self.median_us if self.median_us else 0.0


class ShapeTiming(BaseModel):
    shape: str
    dtype: str
    bucket: str
    candidate: TimingStats
    baselines: dict[str, TimingStats] = Field(default_factory=dict)
    flops: float
    bytes: float
    achieved_gbps: float
    roofline_fraction: float | None = None
    # The judge's own clock per timed call (less the channel's round trip), and the share of it
    # the runner's per-call times and the flushes account for: the bound the events must meet.
    outside_us: float | None = None
    accounted: float | None = None
    checked_calls: int = 0  # timed calls whose outputs were compared with the reference
    # The call's form: "train" where it is a training step's (a gradient problem's, or a forward
    # asked for the statistics its backward reads), "serve" otherwise. Registration decides the
    # graphs an entry serves from them (agent.nodes._winners).
    graph: Literal["serve", "train"] = "serve"


def ratio(value: float) -> str:
    """A speedup as `1.23x`, or with three significant digits where two decimals would show
    nothing (`0.00412x`, an interpreted kernel against a compiled baseline)."""
    return f"{value:.2f}x" if abs(value) >= 0.1 or value == 0 else f"{value:.3g}x"


class DeviceInfo(BaseModel):
    name: str
    arch: str
    torch: str
    triton: str
    python: str
    interpreted: bool
    # CUDA_VISIBLE_DEVICES as the judge ran under it (None: unset): which GPU of its host it was.
    visible_devices: str | None = None

    @property
    def kind(self) -> str:
        """The kind of device, e.g. `NVIDIA H200 (sm_90)`, or `x86_64 (interpreter)` on a CPU:
        timings compare only within one kind (a campaign keeps baselines and incumbents per
        kind), never across GPUs of other models or across hosts' interpreters."""
        return f"{self.name} ({self.arch})"


# The end of the worker's output that a result keeps (EvalResult.log_tail).
LOG_TAIL_CHARS = 4000


class EvalResult(BaseModel):
    status: Status
    problem: str
    candidate_id: str
    message: str = ""
    checks: list[ShapeCheck] = Field(default_factory=list)
    timings: list[ShapeTiming] = Field(default_factory=list)
    device: DeviceInfo | None = None
    log_tail: str = ""
    wall_s: float = 0.0
    timing_window: tuple[float, float] | None = None  # wall-clock start and end of the timing phase
    # Seconds per phase of the judge (setup: its problem's module, and whether it has a GPU;
    # init: its own device; start: the runner's; load, check, timing; finish: the runner's end;
    # and lock_wait: its waits for the GPU's lock while other evaluations time or check, taken
    # out of the phase they interrupted), and on the local backend spawn (until the judge
    # process runs: forked, or started), exit (from its writing its result to the backend's
    # reaping it: its CUDA context torn down, its runner's groups removed) and, where the judge
    # ran out of device memory beside other evaluations and ran again alone,
    # beside_out_of_memory (the first run's time outside its phases); `wall_s` minus their sum
    # is the rest of the judge process's start, before its first phase.
    phase_s: dict[str, float] = Field(default_factory=dict)
    # Seconds the judge held the GPU's lock, "exclusive" (timed batches, calibration, baselines)
    # and "shared" (everything else on the device): what this evaluation took of a GPU that other
    # evaluations share (empty on a CPU, where nothing is locked).
    gpu_held_s: dict[str, float] = Field(default_factory=dict)
    artifacts_reused: bool = False  # the worker started with this source's compiled kernels
    # Other kernels the backend evaluated on the same device right after this one, because that
    # kind of device had not measured them for the caller yet (sandbox.backend.Alongside).
    alongside: list[EvalResult] = Field(default_factory=list)

    @property
    def interpreted(self) -> bool:
        return self.device is not None and self.device.interpreted

    @property
    def kind(self) -> str | None:
        """DeviceInfo.kind of the device it ran on (None: it ran on none, e.g. screened out)."""
        return None if self.device is None else self.device.kind

    @property
    def timed_baselines(self) -> bool:
        """Whether its own timings carry the baselines' (its judge timed them)."""
        return any(t.baselines for t in self.timings)

    def unphased_s(self) -> float:
        """`wall_s` outside every phase: the judge process's start before its first phase (and of
        a failed judge, which reports no phases, its whole life)."""
        return max(0.0, self.wall_s - sum(self.phase_s.values()))

    def geomean_us(self, dtype: str | None = None) -> float | None:
        """Geometric mean of the candidate's median time over the timing shapes (of `dtype`)."""
        times = [t.candidate.median_us for t in self.timings if dtype in (None, t.dtype)]
        return geometric_mean(times) if times else None

    def with_baselines(self, baselines: dict[str, dict[str, TimingStats]]) -> EvalResult:
        """This result with each timing's baselines completed from `baselines` (shape key ->
        name -> stats, measured earlier on the same kind of device: a campaign times them once
        per problem and kind), its own kept where it has them."""
        timings = [
            t.model_copy(update={"baselines": baselines.get(f"{t.shape}/{t.dtype}", {}) | t.baselines})
            for t in self.timings
        ]
        return self.model_copy(update={"timings": timings})

    def speedups(self, baselines: dict[str, dict[str, TimingStats]] | None = None) -> dict[str, float]:
        """Geometric-mean speedup over each baseline, from this result's own baseline timings
        or from `baselines` (shape key -> name -> stats) measured earlier on the same kind of device."""
        ratios: dict[str, list[float]] = {}
        for t in self.timings:
            known = dict(t.baselines)
            if baselines:
                known = baselines.get(f"{t.shape}/{t.dtype}", {}) | known
            for name, stats in known.items():
                ratios.setdefault(name, []).append(stats.median_us / t.candidate.median_us)
        return {name: geometric_mean(values) for name, values in ratios.items()}
