"""The library's default embedding-bag kernels and the `recforge::embedding_bag` op, against the
plain PyTorch reference computed in fp64."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import ops
from kernels.embedding_bag import embedding_bag_forward
from kernels.registry import DISPATCHER
from sandbox.protocol import compare
from search_space import get_problem
from search_space.embedding_bag import CHECK_SHAPES, TIMING_SHAPES, reference
from search_space.problem import Inputs, Shape

PROBLEM = get_problem("embedding_bag")
SHAPE_IDS = [f"{s.name}-{s.dtype}" for s in CHECK_SHAPES]


def _upcast(inputs: Inputs) -> Inputs:
    """fp64 copies of the floating-point inputs (leaf tensors), integer ones as they are."""

    def up(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().double()
        return v

    return Inputs(args=tuple(up(a) for a in inputs.args), kwargs={k: up(v) for k, v in inputs.kwargs.items()})


def assert_matches(out: torch.Tensor, ref64: torch.Tensor, dtype: str, what: str) -> None:
    """`out` within the problem's tolerance for `dtype` of the fp64 `ref64` (the sandbox's rule);
    the failure says which element, by how much, and how many."""
    ok, details = compare(out.double(), ref64, PROBLEM.tolerance(dtype))
    assert ok, (
        f"{what}: {details['message']} (max abs err {details.get('max_abs_err', 0):.3g}, "
        f"relative error norm {details.get('norm_rel_err', 0):.3g})"
    )


def _inputs(shape: Shape, device: torch.device, seed: int = 0) -> Inputs:
    return PROBLEM.make_inputs(shape, seed, device)


# --- forward --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=SHAPE_IDS)
def test_forward_matches_fp64_reference(shape: Shape, device: torch.device) -> None:
    inputs = _inputs(shape, device)
    out = embedding_bag_forward(*inputs.args, **inputs.kwargs)
    ref64 = reference(*_upcast(inputs).args, **_upcast(inputs).kwargs)
    assert out.dtype == shape.torch_dtype
    assert_matches(out, ref64, shape.dtype, f"forward on {shape.describe()}")


@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=SHAPE_IDS)
def test_the_gpu_launch_configuration_matches_too(shape: Shape, monkeypatch, empty_library) -> None:
    """Interpreted, the kernels launch few wide programs (a configuration of their own); the
    tiles a GPU launches (every branch of the heuristics, by dtype and dim) are checked here too,
    forward and backward."""
    import kernels.embedding_bag as module

    forward, backward = module._forward_config, module._backward_config
    monkeypatch.setattr(
        module, "_forward_config", lambda dim, size, ids, interpreted: forward(dim, size, ids)
    )

    monkeypatch.setattr(module, "_backward_config", lambda dim, interpreted: backward(dim))
    _check_op_and_grads(shape, torch.device("cpu"))


def test_the_heuristics_bags_give_way_to_a_searched_id_tile() -> None:
    """A search that fixes 32 ids a step on short fp32 bags (whose heuristic takes 64 bags of 32
    columns) gets 16 bags a program, within the tile bound; fixed bags are left as they are."""
    import kernels.embedding_bag as module

    short = module._forward_config(64, 4, 1.0)
    searched = {**short, "BLOCK_L": 32}
    assert module._fit_tile(searched, heuristic_bags=True)["BLOCK_B"] == 16
    assert module._fit_tile(searched, heuristic_bags=False)["BLOCK_B"] == 64
    assert module._fit_tile(short, heuristic_bags=True) == short
    for size in (2, 4):  # the heuristic's own tiles fit as they are
        for mean_ids in (1.0, 8.0):
            cfg = module._forward_config(256, size, mean_ids)
            assert module._fit_tile(cfg, heuristic_bags=True) == cfg


def test_the_check_shapes_take_both_regimes_tiles() -> None:
    """Short bags (the shape bucket's regime) launch tiles of their own on a GPU: the check
    shapes hold both regimes, so the test above runs both tiles."""
    import kernels.embedding_bag as module
    import search_space.embedding_bag as problem

    assert module.SHORT_BAG_MEAN_IDS == problem.SHORT_BAG_MEAN_IDS
    regimes = set()
    for shape in CHECK_SHAPES:
        _, indices, offsets = _inputs(shape, torch.device("cpu")).args
        if offsets.numel() > 1:
            regimes.add(indices.numel() / (offsets.numel() - 1) <= module.SHORT_BAG_MEAN_IDS)
    assert regimes == {True, False}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", TIMING_SHAPES, ids=[f"{s.name}-{s.dtype}" for s in TIMING_SHAPES])
def test_forward_and_grads_on_production_sizes(shape: Shape, empty_library) -> None:
    """Millions of rows and 64k+ bags: int64 row offsets and fp32 atomics at real contention."""
    _check_op_and_grads(shape, torch.device("cuda"))


# --- backward through the op ----------------------------------------------------------------


def _check_op_and_grads(shape: Shape, device: torch.device) -> None:
    """Forward and every gradient of `ops.embedding_bag` vs autograd of the fp64 reference,
    each side on its own cloned leaf tensors."""
    inputs = _inputs(shape, device)
    weight, indices, offsets = inputs.args
    mode, psw = inputs.kwargs["mode"], inputs.kwargs["per_sample_weights"]
    gen = torch.Generator(device=device).manual_seed(1)
    grad_out = torch.randn(offsets.numel() - 1, weight.shape[1], generator=gen, device=device)
    grad_out = grad_out.to(weight.dtype)

    weight_k = weight.clone().requires_grad_()
    psw_k = None if psw is None else psw.clone().requires_grad_()
    out = ops.embedding_bag(weight_k, indices, offsets, mode=mode, per_sample_weights=psw_k)
    out.backward(grad_out)

    weight_r = weight.detach().double().requires_grad_()
    psw_r = None if psw is None else psw.detach().double().requires_grad_()
    ref = reference(weight_r, indices, offsets, mode=mode, per_sample_weights=psw_r)
    ref.backward(grad_out.double())

    desc = shape.describe()
    assert_matches(out.detach(), ref.detach(), shape.dtype, f"op forward on {desc}")
    assert weight_k.grad is not None and weight_k.grad.dtype == weight.dtype
    assert_matches(weight_k.grad, weight_r.grad, shape.dtype, f"grad of weight on {desc}")
    if psw is not None:
        assert psw_k.grad is not None and psw_k.grad.dtype == psw.dtype
        assert_matches(psw_k.grad, psw_r.grad, shape.dtype, f"grad of per_sample_weights on {desc}")


@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=SHAPE_IDS)
def test_op_backward_matches_fp64_reference(shape: Shape, device: torch.device, empty_library) -> None:
    _check_op_and_grads(shape, device)
    assert DISPATCHER.last["embedding_bag"] == "default"


FALLBACK_SHAPES = [
    s
    for s in CHECK_SHAPES
    if s.dtype == "fp32" and s.name in {"mixed-empty", "dim-100-mean", "weighted", "duplicates"}
]


@pytest.mark.parametrize("shape", FALLBACK_SHAPES, ids=lambda s: s.name)
def test_op_without_triton_falls_back_to_torch(
    shape: Shape, empty_library, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU tensors without the interpreter: forward is the reference, backward plain PyTorch."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _check_op_and_grads(shape, torch.device("cpu"))
    assert DISPATCHER.last["embedding_bag"] == "reference"


# --- launcher validation --------------------------------------------------------------------


def _small(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight = torch.randn(10, 16, device=device)
    indices = torch.tensor([1, 2, 3], device=device)
    offsets = torch.tensor([0, 2, 3], device=device)
    return weight, indices, offsets


BAD_CALLS = {
    "bad-mode": (lambda w, i, o: ((w, i, o), {"mode": "max"}), "mode"),
    "psw-with-mean": (
        lambda w, i, o: (
            (w, i, o),
            {"mode": "mean", "per_sample_weights": torch.ones_like(w[:3, 0])},
        ),
        "per_sample_weights",
    ),
    "psw-wrong-length": (
        lambda w, i, o: ((w, i, o), {"per_sample_weights": torch.ones_like(w[:2, 0])}),
        "per_sample_weights",
    ),
    "weight-1d": (lambda w, i, o: ((w[:, 0], i, o), {}), "weight"),
    "weight-3d": (lambda w, i, o: ((w[None], i, o), {}), "weight"),
    "weight-column-major": (lambda w, i, o: ((w.t().contiguous().t(), i, o), {}), "unit stride"),
    "indices-2d": (lambda w, i, o: ((w, i[None], o), {}), "indices"),
    "offsets-2d": (lambda w, i, o: ((w, i, o[None]), {}), "offsets"),
    "offsets-empty": (lambda w, i, o: ((w, i, o[:0]), {}), "offsets"),
    "float-indices": (lambda w, i, o: ((w, i.float(), o), {}), "int32 or int64"),
}


@pytest.mark.parametrize("fn", [embedding_bag_forward, ops.embedding_bag], ids=["launcher", "op"])
@pytest.mark.parametrize("case", BAD_CALLS, ids=list(BAD_CALLS))
def test_invalid_input_raises_value_error(case: str, fn, device: torch.device) -> None:
    make, message = BAD_CALLS[case]
    args, kwargs = make(*_small(device))
    with pytest.raises(ValueError, match=message):
        fn(*args, **kwargs)


def test_int32_indices_and_offsets(device: torch.device) -> None:
    shape = next(s for s in CHECK_SHAPES if s.name == "mixed-empty" and s.dtype == "fp32")
    weight, indices, offsets = _inputs(shape, device).args
    out = embedding_bag_forward(weight, indices.int(), offsets.int())
    assert_matches(out, reference(weight.double(), indices, offsets), "fp32", "int32 ids")


# --- torch.compile --------------------------------------------------------------------------


@pytest.mark.parametrize("shape_name", ["weighted", "dim-100-mean"])
def test_compiled_matches_eager(shape_name: str, device: torch.device, empty_library) -> None:
    """The custom op's fake implementation and autograd registration let torch.compile trace
    a caller in one graph; the compiled forward and grads equal the eager ones."""
    shape = next(s for s in CHECK_SHAPES if s.name == shape_name and s.dtype == "fp32")
    inputs = _inputs(shape, device)
    weight, indices, offsets = inputs.args
    mode, psw = inputs.kwargs["mode"], inputs.kwargs["per_sample_weights"]

    def pooled_loss(weight, indices, offsets, psw):
        pooled = ops.embedding_bag(weight, indices, offsets, mode=mode, per_sample_weights=psw)
        return pooled, (pooled * pooled).sum()

    results = {}
    for name, fn in [
        ("eager", pooled_loss),
        ("compiled", torch.compile(pooled_loss, backend="aot_eager", fullgraph=True)),
    ]:
        leaves = [
            weight.clone().requires_grad_(),
            None if psw is None else psw.clone().requires_grad_(),
        ]
        pooled, loss = fn(leaves[0], indices, offsets, leaves[1])
        loss.backward()
        results[name] = [pooled.detach()] + [t.grad for t in leaves if t is not None]
    # fp32 atomics on a GPU add in any order: equal up to rounding, not bit for bit.
    for eager, compiled in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


# --- property over random jagged lengths ----------------------------------------------------


@settings(
    max_examples=15,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.integers(0, 70), max_size=12),  # zeros included, 16-index steps crossed
    num_rows=st.integers(1, 300),
    dim=st.integers(1, 160),
    dtype=st.sampled_from(["fp32", "bf16"]),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    duplicates=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_jagged_lengths(
    device: torch.device,
    lengths: list[int],
    num_rows: int,
    dim: int,
    dtype: str,
    mode: str,
    weighted: bool,
    duplicates: bool,
    seed: int,
) -> None:
    shape = Shape(
        name="hypothesis",
        dtype=dtype,
        params={
            "num_rows": num_rows,
            "dim": dim,
            "lengths": lengths,
            "mode": mode,
            "weighted": weighted and mode == "sum",
            "duplicates": duplicates,
        },
    )
    inputs = _inputs(shape, device, seed)
    out = embedding_bag_forward(*inputs.args, **inputs.kwargs)
    ref64 = reference(*_upcast(inputs).args, **_upcast(inputs).kwargs)
    assert_matches(out, ref64, dtype, f"forward on {shape.describe()}")
