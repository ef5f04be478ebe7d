"""Where a training or serving step of the GEM-class model spends its time, per kernel-library
op and shape bucket, with each one's roofline fraction: what the campaign's plan reads.

Every call through `kernels.ops` is traced (kernels.trace): its bucket, the implementation that
ran, its FLOPs and minimum bytes (the op's declared cost) and its time (CUDA events around it on
a GPU, the host's clock on a CPU). The rest of the step is broken down by the torch profiler:
what the GPU ran (on a CPU, the host's time in torch ops) outside the library's calls, grouped
by the outermost op that ran it (`torch: aten::linear`, `torch: MmBackward0`, `torch:
AdamW.step`), so the next kernels can be chosen by it; what is left of the step's time is the
host's and the GPU's idle time (a row of its own). The roofline time of a call is the
larger of its FLOPs at the device's dense peak for its dtype and its bytes at the device's
memory bandwidth; the fraction is that over the measured time (1.0: at the roofline). On a CPU
no peak is known and fractions are left out.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels.trace import RANGE_PREFIX, Call, trace
from model.config import ModelConfig
from model.data import RequestBatch, TrafficGenerator
from model.flops import peak_flops
from model.serving import score, synchronize
from model.training import Trainer

# Memory bandwidth (bytes/s) by device name: the vendors' figures (HBM3e, HBM3, HBM2e).
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
GRAPHS = ("train", "serve")
TORCH = "torch: "  # the rows of the step's time outside the library's ops
IDLE = "host and idle (the step's time in neither)"
TORCH_ROWS = 12  # the largest torch groups get a row each; the rest share one
# Rows adding up to more than the step by this share of it (timing noise aside) count something
# twice: warned of.
OVERCOUNT = 0.05
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def peak_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)


@dataclass
class OpRow:
    op: str
    bucket: str
    dtype: str
    implementations: list[str]
    calls: float  # per step
    ms: float  # per step
    share: float  # of the step's time
    gflops: float | None = None  # per step
    mbytes: float | None = None  # per step
    roofline_ms: float | None = None
    fraction: float | None = None  # roofline_ms / ms

    @property
    def gain_ms(self) -> float:
        """What reaching the roofline would save per step (the whole time where it is unknown)."""
        if self.fraction is None:
            return self.ms
        return max(0.0, self.ms - (self.roofline_ms or 0.0))  # nominal peaks: a row may beat them


@dataclass
class Profile:
    graph: str
    config: str
    device: str
    steps: int
    step_ms: float
    rows: list[OpRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**asdict(self), "rows": [{**asdict(r), "gain_ms": r.gain_ms} for r in self.rows]}

    @property
    def ops(self) -> list[str]:
        """The library's ops the step called."""
        return sorted({r.op for r in self.rows if r.implementations})


def _rows(calls: list[Call], steps: int, step_s: float, device: torch.device) -> list[OpRow]:
    grouped: dict[tuple[str, str, str], list[Call]] = {}
    for c in calls:
        grouped.setdefault((c.op, c.bucket, c.dtype), []).append(c)
    bandwidth = peak_bandwidth(device)
    rows = []
    for (op, bucket, dtype), group in grouped.items():
        seconds = sum(c.seconds or 0.0 for c in group) / steps
        row = OpRow(
            op=op,
            bucket=bucket,
            dtype=dtype,
            implementations=sorted({c.implementation for c in group}),
            calls=len(group) / steps,
            ms=1e3 * seconds,
            share=seconds / step_s if step_s else 0.0,
        )
        if all(c.flops is not None for c in group):
            flops = sum(c.flops or 0.0 for c in group) / steps
            moved = sum(c.bytes or 0.0 for c in group) / steps
            row.gflops, row.mbytes = flops / 1e9, moved / 1e6
            peak = peak_flops(device, _DTYPES.get(dtype, torch.float32))
            if peak is not None and bandwidth is not None and seconds > 0:
                roofline = max(flops / peak, moved / bandwidth)
                row.roofline_ms, row.fraction = 1e3 * roofline, roofline / seconds
        rows.append(row)
    return rows


def _torch_rows(events: list[Any], steps: int, step_s: float, device: torch.device) -> list[OpRow]:
    """The step's time in torch's ops outside the library's calls: on a GPU the device's time of
    the kernels each op launched, on a CPU the host's own time in each op; each grouped under
    the outermost op it ran inside (the `TORCH_ROWS` largest a row each, the rest in one)."""
    on_gpu = device.type == "cuda"
    spent: dict[str, list[float]] = {}  # group: [microseconds, top-level calls]
    tops: set[int] = set()
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.is_async:
            continue  # a kernel's own event: its time is its launching op's too
        own = _self_time_us(event, on_gpu)
        if own <= 0:
            continue
        top, inside = event, event.name.startswith(RANGE_PREFIX)
        while top.cpu_parent is not None and not inside:
            top = top.cpu_parent
            inside = top.name.startswith(RANGE_PREFIX)
        if inside:
            continue
        group = spent.setdefault(_group(top.name), [0.0, 0.0])
        group[0] += own
        if id(top) not in tops:
            tops.add(id(top))
            group[1] += 1
    ranked = sorted(spent.items(), key=lambda kv: -kv[1][0])
    shown, rest = ranked[:TORCH_ROWS], ranked[TORCH_ROWS:]
    if rest:
        shown.append(("other ops", [sum(v[0] for _, v in rest), sum(v[1] for _, v in rest)]))
    return [_rest_row(TORCH + name, us / 1e6 / steps, count / steps, step_s) for name, (us, count) in shown]


def _rest_row(op: str, seconds: float, calls: float, step_s: float) -> OpRow:
    """A row of the step's time that is no library op's (no bucket, dtype or cost)."""
    share = seconds / step_s if step_s else 0.0
    return OpRow(op=op, bucket="-", dtype="-", implementations=[], calls=calls, ms=1e3 * seconds, share=share)


def _self_time_us(event: Any, on_gpu: bool) -> float:
    """A host op's own time in microseconds: on a GPU, that of the kernels it launched itself;
    else the host's."""
    if on_gpu:
        return float(event.self_device_time_total)
    return float(event.self_cpu_time_total)


def _group(name: str) -> str:
    """A profiler event's name as a group: an autograd node's backward by the node's name, an
    optimizer's step by the optimizer's."""
    name = name.removeprefix("autograd::engine::evaluate_function: ")
    return name.split("#", 1)[1] if name.startswith("Optimizer.") and "#" in name else name


class ModelStep:
    """Steps of `graph` ("train": a training step on a training batch; "serve": scoring a serving
    batch of the config's size) on one model built for it.

    `batch(i)`: on the device, a variant of base batch i of `batches` that no step has seen
    (TrafficGenerator.variant: the base batch's sizes, new ids and values), made before the step
    that runs on it: no implementation's memo of earlier answers pays, and a step after one on a
    variant of the same base batch compiles nothing (Triton specializes on integer arguments,
    which the variants share). `run(batch)`: one step on it."""

    def __init__(self, config: ModelConfig, graph: str, device: torch.device, *, batches: int) -> None:
        self.trainer = Trainer(config, device)
        self.traffic = TrafficGenerator(config, seed=config.train.seed)
        self.device = device
        self._gen = torch.Generator().manual_seed(config.train.seed)
        d = config.data
        if graph == "train":
            self.bases = [self.traffic.batch(i) for i in range(batches)]
        else:
            self.bases = [
                self.traffic.batch(
                    i, num_requests=d.serve_requests, candidates_per_request=d.serve_candidates
                )
                for i in range(batches)
            ]
        self.graph = graph

    def batch(self, i: int) -> RequestBatch:
        return self.traffic.variant_on(self.bases[i], self._gen, self.device)

    def run(self, batch: RequestBatch) -> None:
        if self.graph == "train":
            self.trainer.train_step(batch)
        else:
            score(self.trainer.model, batch)


def profile_model(
    config: ModelConfig,
    graph: str,
    device: torch.device | str,
    *,
    steps: int = 3,
    warmup: int = 2,
    trace_file: Path | None = None,
) -> Profile:
    """Profile `steps` steps of `graph` ("train": a training step on a training batch; "serve":
    scoring a serving batch) after `warmup` steps, the profiled steps' base batches each once at
    least (ModelStep): every step on a batch no step saw before, so no memo of earlier answers
    pays, and each profiled step's sizes met in the warm-up, so no kernel compiles in it (Triton
    specializes on integer arguments). With `trace_file`, the torch profiler's trace of the
    profiled steps is written there too (chrome://tracing, Perfetto), each op's call a range
    named recforge::<op>::<bucket>."""
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    device = torch.device(device)
    step = ModelStep(config, graph, device, batches=steps)
    for i in range(max(warmup, steps)):
        step.run(step.batch(i % steps))
    batches = [step.batch(i) for i in range(steps)]
    synchronize(device)
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
        + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    )
    # On a GPU, the step's time and the library's calls are measured without the torch
    # profiler, whose host cost would count in them, then the same steps run under it for what
    # the GPU ran outside the library (kernel times it does not change). On a CPU every row is
    # the host's time, so all of them are measured in one pass under the profiler, alike.
    on_gpu = device.type == "cuda"
    with profiler if not on_gpu else contextlib.nullcontext(), trace(timed=True) as recorded:
        start = time.perf_counter()
        for batch in batches:
            step.run(batch)
        synchronize(device)
        step_s = (time.perf_counter() - start) / steps
    calls = recorded.seconds()
    del batches, batch  # before the next ones are made: one list of batches at a time on the device
    if on_gpu:
        batches = [step.batch(i) for i in range(steps)]
        synchronize(device)
        with profiler, trace():
            for batch in batches:
                step.run(batch)
            synchronize(device)
        del batches, batch
    if trace_file is not None:
        Path(trace_file).parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace_file))
    rows = _rows(calls, steps, step_s, device)
    rows += _torch_rows(profiler.events(), steps, step_s, device)
    rest = step_s - sum(r.ms for r in rows) / 1e3
    if rest < -OVERCOUNT * step_s:
        warnings.warn(
            f"the profile's rows add up to {1e3 * (step_s - rest):.3f} ms of a {1e3 * step_s:.3f} ms step: "
            "some time is counted twice",
            stacklevel=2,
        )
    rows.append(_rest_row(IDLE, max(0.0, rest), 0, step_s))
    rows.sort(key=lambda r: -r.ms)
    return Profile(
        graph=graph,
        config=config.name,
        device=_device_name(device),
        steps=steps,
        step_ms=1e3 * step_s,
        rows=rows,
    )


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
