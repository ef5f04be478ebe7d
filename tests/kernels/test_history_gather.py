"""The history gather (search_space/history_gather.py, kernels/history_gather.py) and its gradient
op (search_space/history_gather_backward.py): the default kernels pass the sandbox's check on
every check shape, interpreted and at a GPU's launch configuration; the op's gradients match
autograd of the fp64 reference; reading in id order (dedup) gives what reading in event order
does; torch.compile traces the op and its backward in one graph; bad arguments are named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import ops
from kernels.history_gather import history_gather, history_gather_backward
from kernels.registry import DISPATCHER
from sandbox.protocol import check_shape, compare
from search_space import get_problem
from search_space.history_gather import CHECK_SHAPES, TIMING_SHAPES, reference
from search_space.problem import Inputs, Shape

FORWARD, BACKWARD = get_problem("history_gather"), get_problem("history_gather_backward")
# The GPU where there is one, else the DEVICE (the kernels then run interpreted).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DEFAULTS = [(FORWARD, history_gather), (BACKWARD, history_gather_backward)]


def _id(shape: Shape) -> str:
    return f"{shape.name}-{shape.dtype}"


def _shapes(*names: str) -> list[Shape]:
    return [s for s in CHECK_SHAPES if s.name in names]


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: str, what: str, problem=FORWARD) -> None:
    """Within `problem`'s tolerance for `dtype` (the sandbox's rule); the failure says where."""
    ok, details = compare(got.to(expected.dtype), expected, problem.tolerance(dtype))
    assert ok, f"{what}: {details['message']}"


# --- the sandbox's check ------------------------------------------------------------------


@pytest.mark.parametrize(("problem", "fn"), DEFAULTS, ids=["forward", "backward"])
@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=_id)
def test_the_default_kernels_pass_the_sandbox_check(problem, fn, shape: Shape) -> None:
    result = check_shape(problem, fn, shape, 0, DEVICE)
    assert result.ok, f"{problem.name} on {shape.describe()}: {result.message}"


@pytest.mark.parametrize(("problem", "fn"), DEFAULTS, ids=["forward", "backward"])
@pytest.mark.parametrize("shape", _shapes("wide", "last-row-int32", "zipf", "repeats-plain"), ids=_id)
def test_the_gpu_launch_configuration_passes_too(problem, fn, shape: Shape, monkeypatch) -> None:
    """Interpreted, the kernels launch few wide programs; the tiles a GPU launches (several
    column blocks, 16 to 128 events a tile) are checked here too."""
    import kernels.history_gather as module

    forward, backward = module._forward_config, module._backward_config
    monkeypatch.setattr(module, "_forward_config", lambda dim, size, interpreted: forward(dim, size))
    monkeypatch.setattr(module, "_backward_config", lambda dim, interpreted: backward(dim))
    result = check_shape(problem, fn, shape, 0, DEVICE)
    assert result.ok, f"{problem.name} on {shape.describe()}: {result.message}"


@pytest.mark.gpu
@pytest.mark.parametrize(("problem", "fn"), DEFAULTS, ids=["forward", "backward"])
@pytest.mark.parametrize("shape", TIMING_SHAPES, ids=_id)
def test_production_sizes(problem, fn, shape: Shape) -> None:
    """Millions of rows, half a million events: int64 row offsets, popular ids whose runs span
    hundreds of tiles, and contended bucket atomics."""
    result = check_shape(problem, fn, shape, 0, torch.device("cuda"))
    assert result.ok, f"{problem.name} on {shape.describe()}: {result.message}"


# --- the op and its gradients -------------------------------------------------------------


def _leaves(inputs: Inputs, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fresh leaf copies of the table and the bucket table (in `dtype`, if given)."""
    table, buckets = inputs.args[0], inputs.kwargs["bucket_table"]
    to = (lambda t: t.detach().to(dtype)) if dtype is not None else (lambda t: t.detach().clone())
    return to(table).requires_grad_(), None if buckets is None else to(buckets).requires_grad_()


def _call(fn, table, bucket_table, inputs: Inputs, **changes) -> torch.Tensor:
    _, ids, offsets = inputs.args
    kwargs = {**inputs.kwargs, "bucket_table": bucket_table, **changes}
    return fn(table, ids, offsets, **kwargs)


GRAD_SHAPES = _shapes("edges", "one-long", "repeats-plain", "last-row-int32", "one-row", "no-events")


@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=_id)
def test_the_op_and_its_gradients_match_autograd_of_the_reference(shape: Shape, empty_library) -> None:
    inputs = FORWARD.make_inputs(shape, 0, DEVICE)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(inputs.args[1].shape[0], shape.params["dim"], generator=gen).to(
        DEVICE, shape.torch_dtype
    )
    table, buckets = _leaves(inputs)
    out = _call(ops.history_gather, table, buckets, inputs)
    out.backward(grad_out)
    table64, buckets64 = _leaves(inputs, torch.float64)
    expected = _call(reference, table64, buckets64, inputs)
    expected.backward(grad_out.double())

    desc = shape.describe()
    assert_close(out.detach(), expected.detach(), shape.dtype, f"forward on {desc}")
    assert table.grad.dtype == table.dtype
    assert_close(table.grad, table64.grad, shape.dtype, f"grad of table on {desc}", BACKWARD)
    if buckets is not None:
        assert_close(buckets.grad, buckets64.grad, shape.dtype, f"grad of bucket_table on {desc}", BACKWARD)
    assert DISPATCHER.last["history_gather"] == "default"
    if out.numel():
        assert DISPATCHER.last["history_gather_backward"] == "default"


def test_a_frozen_table_gets_no_gradient_and_the_buckets_theirs(empty_library) -> None:
    """Positional rows trained over a frozen table: their gradient comes without the table's (no
    dense [num_rows, D] buffer) and equals the one computed beside it."""
    (shape,) = [s for s in _shapes("one-long") if s.dtype == "fp32"]
    inputs = FORWARD.make_inputs(shape, 0, DEVICE)
    grad_out = torch.randn(inputs.args[1].shape[0], shape.params["dim"], device=DEVICE)
    table, buckets = _leaves(inputs)
    _call(ops.history_gather, table.detach(), buckets, inputs).backward(grad_out)
    both = _leaves(inputs)
    _call(ops.history_gather, *both, inputs).backward(grad_out)
    assert_close(buckets.grad, both[1].grad, "fp32", "bucket rows' gradient of a frozen table", BACKWARD)


ORDER_SHAPES = [
    s for s in _shapes("repeats-plain", "zipf") if s.dtype == ("bf16" if s.name == "zipf" else "fp32")
]


@pytest.mark.parametrize("shape", ORDER_SHAPES, ids=_id)
def test_reading_in_id_order_gives_what_reading_in_event_order_does(shape: Shape, empty_library) -> None:
    """The dedup path (events listed by id: stably, or any other grouping) and the plain path:
    the same output bit for bit, and the same gradients up to the order of their sums."""
    inputs = FORWARD.make_inputs(shape, 0, DEVICE)
    ids = inputs.args[1]
    orders = {
        "plain": None,
        "stable": torch.argsort(ids, stable=True),
        "grouped backwards": torch.argsort(ids, stable=True).flip(0),
    }
    grad_out = torch.randn(ids.shape[0], shape.params["dim"], device=DEVICE).to(shape.torch_dtype)
    results = {}
    for name, order in orders.items():
        table, buckets = _leaves(inputs)
        out = _call(ops.history_gather, table, buckets, inputs, order=order)
        out.backward(grad_out)
        results[name] = (out.detach(), table.grad, None if buckets is None else buckets.grad)
    plain = results.pop("plain")
    for name, (out, grad_table, grad_buckets) in results.items():
        assert torch.equal(out, plain[0]), name
        assert_close(grad_table, plain[1], shape.dtype, f"table gradient, {name}", BACKWARD)
        if grad_buckets is not None:
            assert_close(grad_buckets, plain[2], shape.dtype, f"bucket gradient, {name}", BACKWARD)


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "plain"])
def test_torch_compile_traces_the_op_and_its_backward(dedup: bool, empty_library) -> None:
    """The custom ops' fake implementations and autograd registration let torch.compile trace a
    caller in one graph (the backward's sort of the ids too, where the call has no order); the
    compiled forward and gradients equal the eager ones."""
    name = "edges" if dedup else "one-long"  # time buckets and an order; positional, none
    (shape,) = [s for s in _shapes(name) if s.dtype == "fp32"]
    inputs = FORWARD.make_inputs(shape, 0, DEVICE)
    _, ids, offsets = inputs.args
    order, bucket_ids = inputs.kwargs["order"], inputs.kwargs["bucket_ids"]
    assert (order is not None) == dedup

    def embed(table, bucket_table):
        out = ops.history_gather(
            table, ids, offsets, order=order, bucket_ids=bucket_ids, bucket_table=bucket_table
        )
        return out, (out * out).sum()

    results = {}
    for mode, fn in (
        ("eager", embed),
        ("compiled", torch.compile(embed, backend="aot_eager", fullgraph=True)),
    ):
        table, buckets = _leaves(inputs)
        out, loss = fn(table, buckets)
        loss.backward()
        results[mode] = (out.detach(), table.grad, buckets.grad)
    for eager, compiled in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_the_custom_ops_check_out() -> None:
    (shape,) = [s for s in _shapes("edges") if s.dtype == "fp32"]
    inputs = FORWARD.make_inputs(shape, 0, DEVICE)
    table, ids, offsets = inputs.args
    kw = inputs.kwargs
    args = (table.clone().requires_grad_(), ids, offsets, kw["order"], kw["bucket_ids"], kw["bucket_table"])
    torch.library.opcheck(ops.history_gather.custom_op, args)
    grad = BACKWARD.make_inputs(shape, 0, DEVICE)
    torch.library.opcheck(ops.history_gather_backward.custom_op, (*grad.args, *grad.kwargs.values()))


# --- argument errors ----------------------------------------------------------------------


def _small() -> dict:
    ids = torch.tensor([0, 3, 3, 9, 0])
    return {
        "table": torch.randn(10, 16),
        "ids": ids,
        "offsets": torch.tensor([0, 2, 5]),
        "order": torch.argsort(ids, stable=True),
        "bucket_ids": torch.tensor([0, 1, 3, 2, 0]),
        "bucket_table": torch.randn(4, 16),
    }


BAD_CALLS = {
    "table-1d": ({"table": torch.randn(10)}, r"table must be an fp32, bf16 or fp16 \[num_rows, D\]"),
    "table-int": ({"table": torch.zeros(10, 16, dtype=torch.int64)}, "table must be an fp32, bf16 or fp16"),
    "table-column-major": ({"table": torch.randn(16, 10).t()}, "table must have unit stride along D"),
    "ids-2d": ({"ids": torch.zeros(1, 5, dtype=torch.int64)}, "ids must be an int32 or int64 vector"),
    "float-ids": ({"ids": torch.zeros(5)}, "ids must be an int32 or int64 vector"),
    "no-offsets": ({"offsets": torch.zeros(0, dtype=torch.int64)}, r"offsets must have B \+ 1 >= 1 entries"),
    "offsets-short-of-T": ({"offsets": torch.tensor([0, 2, 4])}, "offsets must rise from 0 to T = 5"),
    "offsets-falling": ({"offsets": torch.tensor([0, 3, 2, 5])}, "offsets must rise from 0 to T = 5"),
    "id-past-the-table": ({"ids": torch.tensor([0, 3, 3, 10, 0])}, r"ids must lie in \[0, num_rows = 10\)"),
    "negative-id": ({"ids": torch.tensor([0, -1, 3, 9, 0])}, r"ids must lie in \[0, num_rows = 10\)"),
    "order-short": ({"order": torch.tensor([0, 4, 1, 2])}, r"order must have one entry per id \(T = 5\)"),
    "order-repeats": ({"order": torch.tensor([0, 0, 1, 2, 3])}, "order must be a permutation of"),
    "order-ungrouped": ({"order": torch.arange(5)}, "order must list equal ids together"),
    "bucket-ids-alone": ({"bucket_table": None}, "bucket_ids name rows of a bucket table, but the call has"),
    "bucket-id-past": ({"bucket_ids": torch.tensor([0, 1, 4, 2, 0])}, r"bucket_ids must lie in \[0, num_b"),
    "bucket-ids-short": ({"bucket_ids": torch.tensor([0, 1])}, "bucket_ids must have one entry per id"),
    "bucket-table-width": ({"bucket_table": torch.randn(4, 8)}, r"must be \[num_buckets >= 1, D = 16\]"),
    "no-bucket-rows": ({"bucket_table": torch.randn(0, 16)}, r"bucket_table must be \[num_buckets >= 1"),
    "bucket-table-dtype": (
        {"bucket_table": torch.randn(4, 16, dtype=torch.float64)},
        "bucket_table must be torch.float32 on cpu as table is",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_CALLS, ids=list(BAD_CALLS))
def test_bad_arguments_are_named(case: str) -> None:
    changes, message = BAD_CALLS[case]
    args = _small() | changes
    with pytest.raises(ValueError, match=message):
        ops.history_gather(args.pop("table"), args.pop("ids"), args.pop("offsets"), **args)


def test_bad_gradient_arguments_are_named() -> None:
    a = _small()
    ids, offsets, order = a["ids"], a["offsets"], a["order"]
    with pytest.raises(ValueError, match=r"grad_out must be an fp32, bf16 or fp16 \[T = 5, D\]"):
        ops.history_gather_backward(torch.randn(4, 16), ids, offsets, order, 10)
    with pytest.raises(ValueError, match="order is required"):
        ops.history_gather_backward(torch.randn(5, 16), ids, offsets, None, 10)
    with pytest.raises(ValueError, match="num_rows and num_buckets must be >= 0"):
        ops.history_gather_backward(torch.randn(5, 16), ids, offsets, order, 10, num_buckets=-1)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, num_rows = 9\)"):
        ops.history_gather_backward(torch.randn(5, 16), ids, offsets, order, 9)


# --- a property over random histories ---------------------------------------------------------


@settings(max_examples=10, deadline=None, database=None)
@given(
    lengths=st.lists(st.integers(0, 40), max_size=8),  # zeros included, 32-event tiles crossed
    num_rows=st.integers(1, 60),
    dim=st.integers(1, 70),
    dtype=st.sampled_from(["fp32", "bf16"]),
    dedup=st.booleans(),
    buckets=st.sampled_from([0, 3, -3]),  # none, time buckets, positional
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_histories(lengths, num_rows, dim, dtype, dedup, buckets, seed) -> None:
    shape = Shape(
        name="hypothesis",
        dtype=dtype,
        params=dict(
            num_rows=num_rows,
            dim=dim,
            lengths=lengths,
            dedup=dedup,
            buckets=abs(buckets),
            positional=buckets < 0,
        ),
    )
    for problem, fn in DEFAULTS:
        inputs = problem.make_inputs(shape, seed, DEVICE)
        expected = problem.reference(*inputs.args, **inputs.kwargs)
        ok, details = compare(fn(*inputs.args, **inputs.kwargs), expected, problem.tolerance(dtype))
        assert ok, f"{problem.name} on {shape.describe()}: {details['message']}"
