"""The attention problems (jagged attention, GDPA, target attention): valid and seeded inputs on
every check shape, the reference on all of them, FLOPs against a brute-force count of allowed
pairs, the PyTorch baselines against the reference, and the length distributions."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from sandbox.protocol import compare
from sandbox.screen import screen
from search_space import (
    attention_common,
    gdpa,
    get_problem,
    jagged_attention,
    problem_names,
    target_attention,
)
from search_space import workload as wl
from search_space.attention import allowed_mask
from search_space.attention_common import DRAWN, drawn_scale
from search_space.problem import Shape

NAMES = ("jagged_attention", "gdpa", "target_attention")
PROBLEMS = {name: get_problem(name) for name in NAMES}
CPU = torch.device("cpu")
CHECKS = [(name, shape) for name, p in PROBLEMS.items() for shape in p.check_shapes]


def _id(case) -> str:
    name, shape = case
    return f"{name}-{shape.name}-{shape.dtype}"


def _index_dtype(shape: Shape) -> torch.dtype:
    return torch.int32 if shape.params.get("index_dtype") == "int32" else torch.int64


def _assert_offsets(offsets: torch.Tensor, dtype: torch.dtype, rows: int) -> list[int]:
    assert offsets.dim() == 1 and offsets.dtype == dtype and offsets.numel() >= 1
    bounds = offsets.tolist()
    assert bounds[0] == 0 and bounds[-1] == rows
    assert all(a <= b for a, b in zip(bounds, bounds[1:], strict=False)), "offsets must not decrease"
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def _expected_output_shape(name: str, inputs) -> tuple[int, ...]:
    if name == "target_attention":
        return tuple(inputs.args[0].shape)
    if name == "gdpa" and inputs.kwargs["broadcast_q"]:
        q, kv_offsets = inputs.args[0], inputs.args[4]
        return ((kv_offsets.numel() - 1) * q.shape[0], *q.shape[1:])
    return tuple(inputs.args[0].shape)


# --- registry and contract ------------------------------------------------------------------


def test_problems_are_registered() -> None:
    assert set(NAMES) <= set(problem_names())
    for name, p in PROBLEMS.items():
        assert p.name == p.entry == name and p.op_family == "attention"
        assert p.signature.startswith(f"{name}(") and "scale" in p.signature
        assert p.template == name and p.description
        for shape in (*p.check_shapes, *p.timing_shapes, *p.interpreted_timing_shapes):
            p.tolerance(shape.dtype)
        assert {s.dtype for s in p.check_shapes} == {"fp32", "bf16", "fp16"}
        assert all(s.dtype == "bf16" and p.bucket(s).startswith("d128-") for s in p.timing_shapes)
        # Buckets separate length regimes: every family is timed in more than one.
        assert len({p.bucket(s) for s in p.timing_shapes}) >= 2, name
        # The sandbox's no-op proof uses the first check shape: it must have a non-zero output.
        first = p.without_statistics(p.make_inputs(p.check_shapes[0], 0, CPU))
        assert p.reference(*first.args, **first.kwargs).abs().sum() > 0
        # The softmax problems check the statistics their forwards save, on some check shapes.
        asks = [p.wants_statistics(p.make_inputs(s, 0, CPU)) for s in p.check_shapes]
        assert (any(asks) and not all(asks)) if name != "gdpa" else not any(asks), name


def test_length_regimes() -> None:
    regimes = [attention_common.length_regime(n) for n in (0, 512, 513, 2048, 4096, 8192, 16384)]
    assert regimes == ["short", "short", "medium", "medium", "long", "long", "xlong"]
    assert attention_common.bucket_of(100, 1024) == "d128-medium"


@pytest.mark.slow
def test_dispatch_asks_for_the_bucket_the_problem_gives_its_shape(monkeypatch) -> None:
    """A call of each public attention op resolves the bucket its problem gives the shape of the
    same lengths: from the caller's bound, and from the offsets where it gave none."""
    from kernels import ops
    from kernels.registry import DISPATCHER

    asked = []
    real = DISPATCHER.resolve

    def recording(op, **kw):
        asked.append((op, kw["bucket"]))
        return real(op, **kw)

    monkeypatch.setattr(DISPATCHER, "resolve", recording)
    heads, dim, lengths = 2, 32, [700, 5, 0]
    offsets = torch.tensor([0, 700, 705, 705])
    q, k, v = (torch.randn(705, heads, dim) for _ in range(3))
    ops.jagged_attention(q, k, v, offsets, max_seq_len=max(lengths))
    seeds = torch.randn(4, heads, dim)
    ops.gdpa(seeds, k, v, None, offsets, broadcast_q=True)  # no bound: read from the offsets
    want = attention_common.bucket_of(dim, max(lengths))
    assert want == "d32-medium" and asked == [("jagged_attention", want), ("gdpa", want)]


def test_head_dim_bucket() -> None:
    assert [attention_common.head_dim_bucket(d) for d in (1, 16, 32, 48, 128, 200)] == [
        "d16",
        "d16",
        "d32",
        "d64",
        "d128",
        "d256",
    ]


# --- inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CHECKS, ids=_id)
def test_check_shape_inputs_are_valid(case) -> None:
    name, shape = case
    params, idx = shape.params, _index_dtype(shape)
    inputs = PROBLEMS[name].make_inputs(shape, 7, CPU)
    heads, dim, dtype = params["heads"], params["dim"], shape.torch_dtype
    if name == "jagged_attention":
        q, k, v, offsets = inputs.args
        kw = inputs.kwargs
        assert q.shape == k.shape == v.shape == (q.shape[0], heads, dim)
        assert q.dtype == k.dtype == v.dtype == dtype
        lengths = _assert_offsets(offsets, idx, q.shape[0])
        if "lengths" in params:
            assert lengths == params["lengths"]
        assert max(lengths, default=0) <= kw["max_seq_len"]
        assert kw["activation"] == params.get("activation", "softmax")
        assert kw["causal"] == params.get("causal", True) and kw["scale"] == drawn_scale(params, 7, dim)
        if params.get("max_targets") is None:
            assert kw["num_targets"] is None
        else:
            targets = kw["num_targets"]
            assert targets.shape == (len(lengths),) and targets.dtype == idx
            assert all(0 <= t <= params["max_targets"] for t in targets.tolist())
        if params.get("rel_bias"):
            assert kw["rel_bias"].shape == (heads, params.get("bias_buckets", 32))
            assert kw["rel_bias"].dtype == dtype
        else:
            assert kw["rel_bias"] is None
    elif name == "gdpa":
        q, k, v, q_offsets, kv_offsets = inputs.args
        assert k.shape == v.shape == (k.shape[0], heads, dim) and q.dtype == k.dtype == v.dtype == dtype
        kv_lengths = _assert_offsets(kv_offsets, idx, k.shape[0])
        if inputs.kwargs["broadcast_q"]:
            assert q_offsets is None and q.shape == (params["n_q"], heads, dim)
        else:
            q_lengths = _assert_offsets(q_offsets, idx, q.shape[0])
            assert len(q_lengths) == len(kv_lengths) and q.shape[1:] == (heads, dim)
            if params.get("mode", "self") == "self":
                assert q_lengths == kv_lengths and q_offsets is not kv_offsets
        assert inputs.kwargs["broadcast_q"] == (params.get("mode") == "broadcast")
    else:
        q_cand, k, v, kv_offsets, cand_to_request = inputs.args
        histories = _assert_offsets(kv_offsets, idx, k.shape[0])
        num_cand = q_cand.shape[0]
        assert q_cand.shape == (num_cand, params["seeds"], heads, dim) and q_cand.dtype == dtype
        assert k.shape == v.shape == (k.shape[0], heads, dim)
        assert cand_to_request.shape == (num_cand,) and cand_to_request.dtype == idx
        counts = torch.bincount(cand_to_request.long(), minlength=len(histories)).tolist()
        expected = params.get("cands", [params.get("cands_per_request", 0)] * len(histories))
        assert counts == expected
        if params.get("shuffle") and num_cand > 2:
            # Shuffled candidates come in some other order than grouped by request (for these seeds).
            assert any(
                cand_to_request.tolist() != sorted(cand_to_request.tolist())
                for cand_to_request in (
                    PROBLEMS[name].make_inputs(shape, seed, CPU).args[4] for seed in range(5)
                )
            )


@pytest.mark.parametrize("case", CHECKS, ids=_id)
def test_make_inputs_deterministic_in_the_seed(case) -> None:
    name, shape = case
    p = PROBLEMS[name]
    first, again, other = (p.make_inputs(shape, seed, CPU) for seed in (11, 11, 12))
    assert all(torch.equal(a, b) for a, b in zip(first.tensors(), again.tensors(), strict=True))
    floats = [t for t in first.tensors() if t.is_floating_point() and t.numel()]
    if floats:
        assert not torch.equal(floats[0], other.tensors()[0])


def test_quantile_batches_keep_their_lengths_and_change_order() -> None:
    shape = Shape(
        name="t", dtype="fp32", params={"heads": 1, "dim": 16, "num_seqs": 12, "dist": "power", "max_len": 90}
    )
    orders = [jagged_attention.make_inputs(shape, seed, CPU).args[3].diff().tolist() for seed in range(4)]
    assert all(sorted(o) == wl.quantile_lengths(12, "power", 90) for o in orders)
    assert len({tuple(o) for o in orders}) > 1


# --- reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CHECKS, ids=_id)
def test_reference_runs_on_every_check_shape(case) -> None:
    name, shape = case
    p = PROBLEMS[name]
    inputs = p.make_inputs(shape, 3, CPU)
    out = p.reference(*inputs.args, **inputs.kwargs)
    if p.wants_statistics(inputs):
        out, lse = out
        alone = p.without_statistics(inputs)
        torch.testing.assert_close(out, p.reference(*alone.args, **alone.kwargs), rtol=0, atol=0)
        rows = math.prod(_expected_output_shape(name, inputs)[:-2])
        softmax = inputs.kwargs["activation"] == "softmax"
        assert lse.dtype == torch.float32
        assert tuple(lse.shape) == ((inputs.args[0].shape[-2], rows) if softmax else (0,))
        assert not bool(torch.isnan(lse).any()) and not bool((lse == float("inf")).any())
    assert tuple(out.shape) == _expected_output_shape(name, inputs)
    assert out.dtype == shape.torch_dtype and bool(torch.isfinite(out).all())


def test_target_reference_in_candidate_groups_is_the_same(monkeypatch) -> None:
    shape = next(s for s in target_attention.CHECK_SHAPES if s.name == "unsorted-silu" and s.dtype == "fp32")
    inputs = target_attention.make_inputs(shape, 5, CPU)
    whole = target_attention.reference(*inputs.args, **inputs.kwargs)
    monkeypatch.setattr(target_attention, "REFERENCE_BUDGET", 1)  # one candidate per call
    torch.testing.assert_close(target_attention.reference(*inputs.args, **inputs.kwargs), whole)


# --- roofline counts ------------------------------------------------------------------------


def _brute_pairs(name: str, inputs) -> int:
    """Allowed (query, key) pairs counted from the generated inputs themselves."""
    if name == "jagged_attention":
        q, _, _, offsets = inputs.args
        kw = inputs.kwargs
        lengths = offsets.diff().tolist()
        targets = kw["num_targets"].tolist() if kw["num_targets"] is not None else [0] * len(lengths)
        return sum(
            int(allowed_mask(n, n - min(t, n), kw["causal"], CPU).sum())
            for n, t in zip(lengths, targets, strict=True)
        )
    if name == "gdpa":
        q, _, _, q_offsets, kv_offsets = inputs.args
        kv = kv_offsets.diff().tolist()
        nq = [q.shape[0]] * len(kv) if inputs.kwargs["broadcast_q"] else q_offsets.diff().tolist()
        return sum(a * b for a, b in zip(nq, kv, strict=True))
    q_cand, _, _, kv_offsets, cand_to_request = inputs.args
    histories = kv_offsets.diff()
    return q_cand.shape[1] * int(histories[cand_to_request.long()].sum())


def _fixed_count(shape: Shape) -> bool:
    return not shape.params.get("sampled") and not shape.params.get("random_targets")


@pytest.mark.parametrize("case", [c for c in CHECKS if _fixed_count(c[1])], ids=_id)
def test_flops_equal_a_brute_force_count(case) -> None:
    name, shape = case
    p = PROBLEMS[name]
    pairs = _brute_pairs(name, p.make_inputs(shape, 1, CPU))
    assert p.flops(shape) == pytest.approx(pairs * shape.params["heads"] * 4 * shape.params["dim"])
    assert p.bytes(shape) > 0


def _small(name: str, shape: Shape) -> Shape:
    """A timing shape's configuration (distribution, targets, mode) at a size a CPU generates."""
    params = dict(shape.params, heads=1, dim=16)
    for key in ("num_seqs", "num_requests"):
        if key in params:
            params[key] = 9
    for key in ("max_len", "q_max_len"):
        if key in params:
            params[key] = 37
    if "cands_per_request" in params:
        params["cands_per_request"] = 3
    for key in ("n_q", "seeds", "max_targets"):
        if key in params:
            params[key] = 5
    return Shape(name=shape.name, dtype="fp32", params=params)


@pytest.mark.parametrize(
    "case",
    [(n, s) for n, p in PROBLEMS.items() for s in (*p.timing_shapes, *p.interpreted_timing_shapes)],
    ids=_id,
)
def test_timing_shape_flops_are_exact_for_every_seed(case) -> None:
    name, shape = case
    p = PROBLEMS[name]
    assert p.flops(shape) > 0 and p.bytes(shape) > 0
    small = _small(name, shape)
    expected = p.flops(small) / (small.params["heads"] * 4 * small.params["dim"])
    for seed in range(3):  # the order of the quantile lengths changes, the count does not
        assert _brute_pairs(name, p.make_inputs(small, seed, CPU)) == pytest.approx(expected)


@pytest.mark.parametrize(
    "case",
    [c for c in CHECKS if c[1].dtype == "fp32" and not _fixed_count(c[1])],
    ids=_id,
)
def test_flops_of_random_shapes_are_the_expectation(case) -> None:
    name, shape = case
    p = PROBLEMS[name]
    counts = [_brute_pairs(name, p.make_inputs(shape, seed, CPU)) for seed in range(300)]
    expected = p.flops(shape) / (shape.params["heads"] * 4 * shape.params["dim"])
    assert statistics.fmean(counts) == pytest.approx(expected, rel=0.1)


def test_jagged_flops_and_bytes_by_hand() -> None:
    shape = Shape(
        name="t",
        dtype="fp32",
        params={
            "heads": 1,
            "dim": 4,
            "lengths": [2, 3],
            "max_targets": 1,
            "rel_bias": True,
            "bias_buckets": 8,
        },
    )
    # n = 2, one target: the history token sees itself (1), the target the history and itself (2).
    # n = 3: history of 2 sees 1 + 2, the target 2 + 1. Pairs 3 + 6 = 9, each 4 D = 16 FLOPs.
    assert jagged_attention.flops(shape) == 9 * 16
    # q, k, v, out: 4 x 5 tokens x 4 x 4 B; offsets 3 x 8 B; targets 2 x 8 B; bias 8 x 4 B.
    assert jagged_attention.bytes_moved(shape) == 320 + 24 + 16 + 32


def test_gdpa_and_target_bytes_by_hand() -> None:
    broadcast = Shape(
        name="t",
        dtype="bf16",
        params={"heads": 1, "dim": 8, "mode": "broadcast", "n_q": 3, "lengths": [4, 0]},
    )
    # seeds read once (3 rows), output 2 x 3 rows, k and v 4 rows each; 2-byte elements; offsets 3 x 8 B.
    assert gdpa.bytes_moved(broadcast) == (3 + 6 + 8) * 8 * 2 + 24
    target = Shape(
        name="t", dtype="fp32", params={"heads": 2, "dim": 4, "seeds": 3, "lengths": [5, 1], "cands": [1, 2]}
    )
    # q and out 2 x 3 candidates x 3 seeds, k and v 2 x 6 rows, of 2 x 4 x 4 B; offsets 3, map 3 x 8 B.
    assert target_attention.bytes_moved(target) == (18 + 12) * 32 + 6 * 8
    assert target_attention.flops(target) == 3 * (5 + 1 + 1) * 2 * 4 * 4


# --- baselines ------------------------------------------------------------------------------


def _baseline_cases():
    for name, p in PROBLEMS.items():
        for shape in p.check_shapes:
            for baseline in p.baselines:
                yield name, shape, baseline
            for baseline, extra in p.shape_baselines.items():
                if extra.applies(shape):
                    yield name, shape, baseline


@pytest.mark.parametrize(
    "case", list(_baseline_cases()), ids=lambda c: f"{c[0]}-{c[1].name}-{c[1].dtype}-{c[2]}"
)
def test_baselines_agree_with_the_reference(case) -> None:
    name, shape, baseline = case
    p = PROBLEMS[name]
    fn = p.baselines.get(baseline) or p.shape_baselines[baseline].fn
    inputs = p.without_statistics(p.make_inputs(shape, 21, CPU))  # baselines compute the output
    ref = p.reference(*inputs.clone().args, **inputs.kwargs)
    ok, details = compare(fn(*inputs.args, **inputs.kwargs), ref, p.tolerance(shape.dtype))
    assert ok, details.get("message")


def test_shape_baselines_say_where_they_apply() -> None:
    for name in ("jagged_attention", "target_attention"):
        flex = PROBLEMS[name].shape_baselines["torch.flex_attention"]
        applies = {
            s.params.get("activation", "softmax"): flex.applies(s) for s in PROBLEMS[name].check_shapes
        }
        assert applies == {"softmax": True, "silu": False}
    silu = next(s for s in jagged_attention.CHECK_SHAPES if s.name == "silu")
    inputs = jagged_attention.make_inputs(silu, 0, CPU)
    with pytest.raises(ValueError, match="softmax"):
        jagged_attention.torch_flex(*inputs.args, **inputs.kwargs)


@pytest.mark.parametrize(
    ("name", "shape_name"),
    [
        ("jagged_attention", "silu-targets-bias"),
        ("jagged_attention", "targets-bias"),
        ("gdpa", "d128-broadcast-silu"),
        ("target_attention", "unsorted-silu"),
        ("target_attention", "mixed-softmax"),
    ],
)
def test_baselines_in_small_chunks_are_the_same(monkeypatch, name: str, shape_name: str) -> None:
    p = PROBLEMS[name]
    shape = next(s for s in p.check_shapes if s.name == shape_name and s.dtype == "fp32")
    inputs = p.without_statistics(p.make_inputs(shape, 4, CPU))
    whole = {b: fn(*inputs.args, **inputs.kwargs) for b, fn in p.baselines.items()}
    module = {"jagged_attention": jagged_attention, "gdpa": gdpa, "target_attention": target_attention}[name]
    # A budget of a few elements: one row of scores, one sequence of mask, one candidate's copy.
    for mod in (attention_common, module):
        monkeypatch.setattr(mod, "DENSE_BUDGET", 1, raising=False)
    for b, fn in p.baselines.items():
        torch.testing.assert_close(fn(*inputs.args, **inputs.kwargs), whole[b])


def test_index_cache_keys_on_the_very_tensors() -> None:
    cache, builds = attention_common.IndexCache(), []

    def build():
        builds.append(1)
        return len(builds)

    offsets = torch.tensor([0, 2, 5])
    assert cache.get((offsets, None), (True,), build) == 1
    assert cache.get((offsets, None), (True,), build) == 1  # same tensor: cached
    assert cache.get((offsets, None), (False,), build) == 2  # other parameters
    assert cache.get((offsets.clone(), None), (True,), build) == 3  # equal values, other tensor
    offsets[1] = 3  # changed in place
    assert cache.get((offsets, None), (True,), build) == 4


# --- screen ---------------------------------------------------------------------------------

_KERNEL = """
import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(q_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(q_ptr + offs[:, None] * BLOCK + offs[None, :])
    tl.store(out_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(x, x))


def jagged_attention(q, k, v, offsets, **kwargs):
    out = torch.empty_like(q)
    _kernel[(1,)](q, out, BLOCK=16)
    return {fallback}
"""


@pytest.mark.parametrize(
    "fallback",
    [
        "torch.nn.functional.scaled_dot_product_attention(q, k, v)",
        "torch.softmax(q @ k.T, -1)",
        "torch.matmul(q, k)",
        "torch.einsum('thd,shd->hts', q, k)",
        "q.bmm(k)",
        "torch.nn.functional.silu(q)",
    ],
)
def test_screen_rejects_torch_attention(fallback: str) -> None:
    forbidden = PROBLEMS["jagged_attention"].forbidden_ops
    assert not screen(_KERNEL.format(fallback="out"), "jagged_attention", forbidden)  # tl.dot is fine
    violations = screen(_KERNEL.format(fallback=fallback), "jagged_attention", forbidden)
    assert any(v.rule in ("fallback", "torch") for v in violations), violations


# --- length distributions -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dist", "min_frac"), [("fixed", 0.9), ("uniform", 0.9), ("uniform", 0.0), ("power", 0.9)]
)
def test_length_pmf_matches_the_quantiles(dist: str, min_frac: float) -> None:
    pmf = wl.length_pmf(dist, 200, min_frac)
    assert sum(p for _, p in pmf) == pytest.approx(1.0)
    assert all(0 <= n <= 200 and p >= 0 for n, p in pmf)
    quantiles = wl.quantile_lengths(4000, dist, 200, min_frac)
    assert statistics.fmean(quantiles) == pytest.approx(sum(n * p for n, p in pmf), rel=0.01)


def test_power_law_histories_look_like_user_histories() -> None:
    lengths = wl.quantile_lengths(512, "power", 4096)
    assert 400 <= statistics.median(lengths) <= 600  # about 500
    assert statistics.fmean(lengths) == pytest.approx(1024, rel=0.01)
    assert max(lengths) <= 4096 and lengths.count(0) > 0
    near = wl.quantile_lengths(512, "uniform", 1024)
    assert min(near) >= 922 and max(near) == 1024
    with pytest.raises(ValueError, match="zipf"):
        wl.length_at(0.5, "zipf", 10)


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", list(_baseline_cases()), ids=lambda c: f"{c[0]}-{c[1].name}-{c[1].dtype}-{c[2]}"
)
def test_baselines_agree_with_the_reference_on_the_gpu(case) -> None:
    """FlashAttention, the memory-efficient backend, compiled flex_attention and the fp32-output
    products on the GPU, at the check shapes."""
    name, shape, baseline = case
    p = PROBLEMS[name]
    fn = p.baselines.get(baseline) or p.shape_baselines[baseline].fn
    device = torch.device("cuda")
    inputs = p.without_statistics(p.make_inputs(shape, 21, device))
    ref = p.reference(*inputs.clone().args, **inputs.kwargs)
    ok, details = compare(fn(*inputs.args, **inputs.kwargs), ref, p.tolerance(shape.dtype))
    assert ok, details.get("message")


@pytest.mark.parametrize("name", ["jagged_attention", "gdpa", "target_attention"])
def test_scale_is_drawn_on_every_check_shape_that_names_none(name: str) -> None:
    """Every activation and mode meets an explicit scale: a check shape that names no scale has it
    drawn per call (the default half the time, else between half and twice D ** -0.5), while
    timing shapes keep the default."""
    problem = PROBLEMS[name]
    drawn = [s for s in problem.check_shapes if s.params.get("scale") == DRAWN]
    assert drawn and all("scale" in s.params for s in problem.check_shapes)
    assert all(s.params.get("scale") != DRAWN for s in problem.timing_shapes)
    for shape in drawn[:3]:
        dim = shape.params["dim"]
        scales = [problem.make_inputs(shape, seed, CPU).kwargs["scale"] for seed in range(16)]
        assert scales[1::2] == [None] * 8, scales  # odd seeds: the default
        assert all(0.5 * dim**-0.5 <= x <= 2.0 * dim**-0.5 for x in scales[::2]), scales
        assert len(set(scales[::2])) == 8  # even seeds: a scale of their own


@pytest.mark.parametrize("name", ["jagged_attention", "target_attention"])
def test_the_other_form_asks_for_the_statistics_where_the_shape_does_not(name: str) -> None:
    problem = PROBLEMS[name]
    for shape in problem.check_shapes[:6]:
        inputs = problem.make_inputs(shape, 3, CPU)
        other = problem.in_other_form(inputs)
        assert problem.wants_statistics(other) != problem.wants_statistics(inputs)
        assert problem.wants_statistics(problem.in_other_form(other)) == problem.wants_statistics(inputs)
        assert other.args is inputs.args  # the same tensors, only the request differs
