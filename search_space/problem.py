"""The `Problem` contract shared by the sandbox, the agent, the benchmarks and the tests."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One input configuration of a problem: a name for reports plus the generator's params."""

    name: str
    dtype: str
    params: Mapping[str, Any]

    @classmethod
    def of(cls, name: str, dtype: str, **params: Any) -> Shape:
        """A shape from its params as keywords: the problems' shorthand for their shape lists."""
        return cls(name=name, dtype=dtype, params=params)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name} [{self.dtype}; {inner}]"


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """Closeness rule: |out - ref| <= atol * scale + rtol * |ref| element-wise, with scale the
    output's root-mean-square, or the problem's `error_scale` where that is larger.

    atol is relative to a magnitude of the call, not absolute, so that returning zeros cannot
    pass on outputs of small magnitude, and `norm_rtol` bounds ||out - ref|| / ||ref|| as a whole.
    """

    atol: float
    rtol: float
    norm_rtol: float
    # Per row (the output's first dimension): ||out_r - ref_r|| <= row_rtol * ||ref_r|| +
    # row_atol * scale * sqrt(row width). None: no row bound. Each problem derives them from its
    # dtype's rounding beside its tolerance table.
    row_rtol: float | None = None
    row_atol: float | None = None

    @property
    def bounds_rows(self) -> bool:
        """Whether a few wrong rows fail it: an exact rule, or one with a per-row bound (element
        and whole-output bounds alone let 1% of the rows be zeros, or every row sit on a grid as
        coarse as the tolerance)."""
        exact = self.atol == self.rtol == self.norm_rtol == 0.0
        return exact or (self.row_rtol is not None and self.row_atol is not None)


# The passes a problem optimizes (Problem.optimizes): an op's forward, its backward (a gradient
# problem: fn(grad_out, *forward inputs) -> gradients), or the training pair, forward then
# backward with a given grad_out.
PASSES = ("forward", "backward", "train")


# A shape parameter whose value is DRAWN is drawn per call from the call's seed by the problem's
# make_inputs (search_space.attention_common.drawn_scale); the judge names the drawn value in a
# failure's message, so that it can be reproduced.
DRAWN = "drawn"


@dataclass(frozen=True, kw_only=True)
class Statistics:
    """What a forward saves for its backward (softmax's log-sum-exp), part of the forward's
    contract: a call that passes `flag=True` gets (output, statistics) back, checked against the
    reference's under `tolerances`, so that a registered forward spares training a second,
    default forward for them."""

    flag: str  # the keyword that asks for them, e.g. "return_lse"
    description: str  # layout and meaning, for the prompt and the docs
    tolerances: Mapping[str, Tolerance]  # by the inputs' dtype


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """Positional and keyword arguments of one call, as the entry function takes them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        values = list(self.args) + list(self.kwargs.values())
        return [v for v in values if isinstance(v, torch.Tensor)]

    def clone(self) -> Inputs:
        def c(v: Any) -> Any:
            return v.clone() if isinstance(v, torch.Tensor) else v

        return Inputs(args=tuple(c(a) for a in self.args), kwargs={k: c(v) for k, v in self.kwargs.items()})


@dataclass(frozen=True, kw_only=True)
class ShapeBaseline:
    """A baseline that computes the op for some shapes only, e.g. a softmax-only method on a
    problem whose shapes also use pointwise activations."""

    fn: Callable[..., torch.Tensor]
    applies: Callable[[Shape], bool]


def compile_whole(reference: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.compile of the whole reference, static: compiled once per timing shape."""
    return torch.compile(reference, dynamic=False)


@dataclass(frozen=True, kw_only=True)
class Problem:
    """An op to optimize: what a candidate must compute, on which inputs, and how well.

    `reference` is plain PyTorch computed in fp32 (or better); `baselines` are the production
    implementations a kernel is compared with (eager PyTorch ops), timed like the candidate.
    """

    name: str
    op_family: str
    entry: str
    signature: str
    description: str
    check_shapes: tuple[Shape, ...]
    timing_shapes: tuple[Shape, ...]
    interpreted_timing_shapes: tuple[Shape, ...]
    tolerances: Mapping[str, Tolerance]
    make_inputs: Callable[[Shape, int, torch.device], Inputs]
    reference: Callable[..., torch.Tensor]
    baselines: Mapping[str, Callable[..., torch.Tensor]]
    flops: Callable[[Shape], float]
    bytes: Callable[[Shape], float]
    bucket: Callable[[Shape], str]
    template: str | None = None
    # Baselines for some shapes only: benchmarks time them where they apply. The worker times
    # `baselines` alone, on every timing shape, so those must compute every shape.
    shape_baselines: Mapping[str, ShapeBaseline] = field(default_factory=dict)
    # torch functions that compute this op: a candidate may not fall back to them.
    forbidden_ops: tuple[str, ...] = ()
    # torch ops (aten names, "sum") that host code may run on floating-point tensors beyond
    # allocation, views, copies and casts (sandbox.host_ops): a final reduction of per-program
    # partial sums, say. Host code computing anything else on floating-point data is suspicious.
    host_float_ops: tuple[str, ...] = ()
    # A problem whose op is data movement (a copy with a layout): host code that copies, clones
    # or fills floating-point tensors is computing it (sandbox.host_ops.DATA_MOVEMENT).
    host_copies_compute: bool = False
    # What the candidate screen's allowlist (sandbox.screen) lets through for this problem only:
    # dotted names ("torch.cumsum") and attribute names ("sum") its host code needs.
    screen_extras: tuple[str, ...] = ()
    # What a campaign times its candidates against when its config names no baselines; None:
    # every baseline (see sandbox.protocol.all_baselines). Problems whose plain reference takes
    # minutes at the timing shapes (a Python loop over sequences) leave it out.
    campaign_baselines: tuple[str, ...] | None = None
    # How the "reference.compile" baseline is built from `reference`. References that loop over
    # jagged sequences compile their per-sequence part instead (search_space.attention).
    compile_reference: Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]] = compile_whole
    # The magnitude a correct kernel's rounding errors come with, from the call's inputs, where
    # that exceeds the output's RMS (Tolerance's default); None: the output's RMS. For several
    # outputs, one such value, or a tuple of one per output.
    error_scale: Callable[[Inputs], float | None | tuple] | None = None
    # The pass this problem's candidates compute (one of PASSES).
    optimizes: str = "forward"
    # What its forward saves for the backward, returned on request; None: nothing.
    statistics: Statistics | None = None
    # The arguments the op updates in place, by name (an optimizer's weights and state): such an
    # op returns None, and what a call computed is their values after it (Problem.result), each
    # compared under the tolerance of its own dtype (an fp32 state beside bf16 weights).
    updates: tuple[str, ...] = ()
    # What a correct result has that no tolerance can see (that a stochastic rounding is
    # unbiased, that what the op must leave alone is left bit for bit): fn(the call's pristine
    # inputs, what it computed (Problem.result)) -> what is wrong, or None. The judge asks it
    # of every result that is within the tolerance.
    verify: Callable[[Inputs, Any], str | None] | None = None

    def __post_init__(self) -> None:
        if self.optimizes not in PASSES:
            raise ValueError(f"problem {self.name!r}: optimizes {self.optimizes!r}, not one of {PASSES}")
        unknown = set(self.updates) - set(_parameter_names(self.reference))
        if unknown:
            raise ValueError(
                f"problem {self.name!r}: updates {sorted(unknown)}, not arguments of its reference"
            )
        if self.updates and self.statistics is not None:
            raise ValueError(f"problem {self.name!r}: an op that updates its arguments returns no statistics")
        for dtype, tol in self.tolerances.items():
            if not tol.bounds_rows:
                raise ValueError(
                    f"problem {self.name!r}: its {dtype} tolerance bounds no output row (row_rtol, "
                    "row_atol): derive them from the dtype's rounding beside the table, or make it exact"
                )

    def tolerance_scale(self, inputs: Inputs) -> float | None:
        return None if self.error_scale is None else self.error_scale(inputs)

    def wants_statistics(self, inputs: Inputs) -> bool:
        """Whether this call asks for the forward's statistics beside its output."""
        return self.statistics is not None and bool(inputs.kwargs.get(self.statistics.flag))

    def without_statistics(self, inputs: Inputs) -> Inputs:
        """The call without its request for statistics: what baselines (which compute the output
        alone, as serving does) are called with."""
        if self.statistics is None or self.statistics.flag not in inputs.kwargs:
            return inputs
        kwargs = {k: v for k, v in inputs.kwargs.items() if k != self.statistics.flag}
        return Inputs(args=inputs.args, kwargs=kwargs)

    def in_other_form(self, inputs: Inputs) -> Inputs:
        """The call in the forward's other form: asking for the statistics where it did not, and
        the reverse (unchanged for a problem without statistics). The judge checks every check
        shape in both forms, so that neither is checked on a few hand-picked shapes only."""
        if self.statistics is None:
            return inputs
        if self.wants_statistics(inputs):
            return self.without_statistics(inputs)
        return Inputs(args=inputs.args, kwargs={**inputs.kwargs, self.statistics.flag: True})

    def closeness(
        self, dtype: str, inputs: Inputs, ref: Any
    ) -> tuple[Tolerance | tuple, float | None | tuple]:
        """(tolerance, error scale) to compare a call's output with, given the reference's output
        `ref`. Where the call asks for the statistics: per output, (output, statistics). Where the
        op returns (or updates) several tensors, each is judged by the tolerance of its own
        dtype: a bf16 call's fp32 gradient of a parameter is held to fp32's bounds, not to
        bf16's, which would let it come back rounded to bf16."""
        tol, scale = self.tolerance(dtype), self.tolerance_scale(inputs)
        if self.wants_statistics(inputs):
            assert self.statistics is not None
            if dtype not in self.statistics.tolerances:
                raise ValueError(f"problem {self.name!r} has no statistics tolerance for dtype {dtype!r}")
            return (tol, self.statistics.tolerances[dtype]), (scale, None)
        if isinstance(ref, tuple):
            return tuple(self._tolerance_of(t, tol, i) for i, t in enumerate(ref)), scale
        return tol, scale

    def _tolerance_of(self, output: Any, call_tolerance: Tolerance, index: int) -> Tolerance:
        """The tolerance of output `index` of several: its dtype's (the call's for what is not a
        tensor: the comparison then says what is wrong). An output of a dtype the problem sets
        no tolerance for is the problem's error, never judged by another dtype's bounds."""
        if not isinstance(output, torch.Tensor):
            return call_tolerance
        name = DTYPE_NAMES.get(output.dtype)
        if name not in self.tolerances:
            raise ValueError(
                f"problem {self.name!r}: output {index} is {output.dtype}, a dtype it sets no tolerance for"
            )
        return self.tolerances[name]

    def updated(self, inputs: Inputs) -> list[bool]:
        """For each of `inputs.tensors()`, in order, whether the call updates it in place."""
        if not self.updates:
            return [False] * len(inputs.tensors())
        names = _parameter_names(self.reference)
        named = [*zip(names, inputs.args, strict=False), *inputs.kwargs.items()]
        return [name in self.updates for name, value in named if isinstance(value, torch.Tensor)]

    def result(self, inputs: Inputs, returned: Any) -> Any:
        """What a call on `inputs` computed: what it returned, or, for an op that updates its
        arguments in place (`updates`), those arguments as the call left them, a tuple in the
        order the call takes them (it returned None, which the caller checks)."""
        if not self.updates:
            return returned
        return tuple(t for t, updated in zip(inputs.tensors(), self.updated(inputs), strict=True) if updated)

    def tolerance(self, dtype: str) -> Tolerance:
        if dtype not in self.tolerances:
            raise ValueError(f"problem {self.name!r} has no tolerance for dtype {dtype!r}")
        return self.tolerances[dtype]


@functools.lru_cache(maxsize=256)
def _parameter_names(fn: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


# --- where problems are declared ---------------------------------------------------------------
#
# A problem is declared in its own module, found by its name: `search_space/<name>.py` defines
# PROBLEM (and, for a searchable kernel, TEMPLATE). Ops outside this package (a plug-in, a test's
# own op) name their modules in RECFORGE_OPS, comma-separated; each defines PROBLEM or PROBLEMS
# (and TEMPLATE, or TEMPLATES by problem name). The sandbox's judge sees the same variable.

PLUGINS_ENV = "RECFORGE_OPS"


def plugin_modules() -> list[str]:
    """The modules RECFORGE_OPS names, in order."""
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


def declarations(module: ModuleType, name: str, kind: type) -> list:
    """What a module declares as `name` (one object of `kind`) and `name + "S"` (several)."""
    found = list(getattr(module, name + "S", ()))
    if isinstance(getattr(module, name, None), kind):
        found.insert(0, getattr(module, name))
    return found


def _problems_of(module: ModuleType) -> list[Problem]:
    return declarations(module, "PROBLEM", Problem)


def _plugin(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(f"{PLUGINS_ENV} names module {name!r}, which does not import: {exc}") from exc


def _builtin(name: str) -> ModuleType | None:
    """search_space.<name>, if it exists and declares the problem `name`."""
    if not name.isidentifier() or importlib.util.find_spec(f"search_space.{name}") is None:
        return None
    module = importlib.import_module(f"search_space.{name}")
    return module if any(p.name == name for p in _problems_of(module)) else None


def problem_module(name: str) -> ModuleType:
    """The module that declares problem `name`; ValueError naming the known ones otherwise."""
    module = _builtin(name)
    if module is not None:
        return module
    for plugin in plugin_modules():
        module = _plugin(plugin)
        if any(p.name == name for p in _problems_of(module)):
            return module
    raise ValueError(f"unknown problem {name!r}; known problems: {', '.join(problem_names())}")


def builtin_problem_names() -> list[str]:
    """The problems this package's own modules declare (no plug-in is imported)."""
    import search_space

    return sorted(
        info.name
        for info in pkgutil.iter_modules(search_space.__path__)
        if not info.ispkg and _builtin(info.name) is not None
    )


def problem_names() -> list[str]:
    """Every problem: this package's modules that declare one, then the plug-ins'."""
    names = set(builtin_problem_names())
    for plugin in plugin_modules():
        names.update(p.name for p in _problems_of(_plugin(plugin)))
    return sorted(names)


def get_problem(name: str) -> Problem:
    """The problem called `name`; ValueError naming the known ones otherwise."""
    return next(p for p in _problems_of(problem_module(name)) if p.name == name)
