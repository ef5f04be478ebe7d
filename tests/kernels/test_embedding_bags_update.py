"""embedding_bags_update: the optimizer step fused into the table-batched embeddings' backward,
in place. The default kernel against the reference on every check shape (the protocol's check,
which compares the updated weights and state), several steps against the reference and against
torch's sparse path, hot rows split across programs whatever the chunk, stochastic rounding
unbiased, the public op (a custom op that says what it updates) under torch.compile, argument
errors, and the sandbox's verdict on the default kernel, on one that skips the hot rows and on
one that updates on the host."""

from __future__ import annotations

import pytest
import torch
from cuda_compile import in_subprocess

import kernels.embedding_bags_update as kernel
import kernels.kit.embeddings as numbering
from kernels import ops
from sandbox import Candidate, LocalBackend, Status, isolation
from sandbox.protocol import check_shape
from search_space import get_problem
from search_space.embedding_bags_update import reference, rounding_bounds, torch_sparse_update
from search_space.problem import Inputs, Shape
from search_space.template import get_template

PROBLEM = get_problem("embedding_bags_update")


@pytest.mark.slow
def test_the_default_kernel_passes_every_check_shape(device: torch.device) -> None:
    for trial, shape in enumerate(PROBLEM.check_shapes):
        result = check_shape(PROBLEM, ops.embedding_bags_update, shape, trial, device, repeat=True)
        assert result.ok, (shape.name, shape.dtype, result.message)


@pytest.mark.slow
def test_the_gpus_tile_passes_every_bf16_check_shape(monkeypatch, device: torch.device) -> None:
    """The GPU's tile (few chunks a program, one id a step, 32 columns of rows of up to 256):
    rows wider than a block take two passes under adagrad (norm, then step), one under SGD. On
    the bf16 check shapes, which take every path (both optimizers, scaled and stochastic); the
    rest would only cost the interpreter time (on a GPU every test here runs this tile)."""
    for name, value in kernel._config(256, interpreted=False).items():
        monkeypatch.setitem(kernel.KNOBS, name, value)
    shapes = [shape for shape in PROBLEM.check_shapes if shape.dtype == "bf16"]
    assert {shape.params.get("optimizer", "adagrad") for shape in shapes} == {"adagrad", "sgd"}
    for trial, shape in enumerate(shapes):
        result = check_shape(PROBLEM, kernel.embedding_bags_update, shape, trial, device)
        assert result.ok, (shape.name, shape.dtype, result.message)


@pytest.mark.slow
@pytest.mark.parametrize("wide", [("places",), ("places", "keys")], ids=["places", "keys-and-places"])
def test_int64_places_and_keys_pass_every_check_shape(wide: tuple[str, ...], monkeypatch, device) -> None:
    """Buffers of 2^31 elements or more keep the places of their rows (a gradient row's start in
    grad_out, a table row's in weights) in int64, and tables of 2^31 rows or more (so of as many
    elements) sort int64 keys too: the same kernels on the other types."""
    for name in wide:
        monkeypatch.setattr(kernel, f"INT32_{name.upper()}_BELOW", 0)
    for trial, shape in enumerate(PROBLEM.check_shapes):
        result = check_shape(PROBLEM, kernel.embedding_bags_update, shape, trial, device)
        assert result.ok, (shape.name, shape.dtype, result.message)


def _hot(optimizer: str, dtype: str = "fp32") -> Shape:
    return Shape(
        name="hot",
        dtype=dtype,
        params=dict(
            tables=[[30, 48], [5, 16]],
            features=[0, 1, 0],
            batch=50,
            max_lens=[9, 4, 30],
            hot_rows=2,
            optimizer=optimizer,
        ),
    )


@pytest.mark.parametrize("chunk", [16, 64, 256])
def test_rows_longer_than_a_chunk_are_summed_across_programs(
    chunk: int, monkeypatch, device: torch.device
) -> None:
    """Hot ids (hundreds per row) span several chunks at 16 and 64, one at 256: each way, every
    row is updated once with its whole gradient."""
    monkeypatch.setitem(kernel.KNOBS, "CHUNK", chunk)
    for optimizer in ("sgd", "adagrad"):
        result = check_shape(PROBLEM, kernel.embedding_bags_update, _hot(optimizer), 0, device)
        assert result.ok, (chunk, optimizer, result.message)


def test_without_the_long_rows_pass_hot_rows_are_wrong(monkeypatch, device: torch.device) -> None:
    """The check is not blind to the second launch: rows over a chunk updated by nobody fail."""
    monkeypatch.setattr(kernel, "_long_rows_kernel", _NoLaunch())
    result = check_shape(PROBLEM, kernel.embedding_bags_update, _hot("adagrad"), 0, device)
    assert not result.ok and "outside tolerance" in result.message


class _NoLaunch:
    """A kernel whose launches do nothing (kernel[grid](...) is a no-op)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _numbering_by_torch(row_offsets, indices, offsets, batch: int, chunk: int, int32_keys: bool):
    """number_chunks's outputs, by plain torch ops: each id's bag by a search, the keys sorted,
    the chunk starts flagged and counted."""
    nnz = indices.numel()
    positions = torch.arange(nnz, device=indices.device)
    bag = torch.searchsorted(offsets[1:].long(), positions, right=True)
    keys = row_offsets[bag // batch] + indices.long()
    sorted_keys, order = torch.sort(keys.to(torch.int32) if int32_keys else keys, stable=True)
    flags = torch.ones(nnz, dtype=torch.bool, device=indices.device)
    flags[1:] = sorted_keys[1:] != sorted_keys[:-1]
    flags |= positions % chunk == 0
    chunk_end = torch.cumsum(flags, 0)
    starts = torch.full((nnz + 1,), nnz, dtype=torch.int64, device=indices.device)
    starts[chunk_end[flags] - 1] = positions[flags]
    return bag, sorted_keys, order, starts, chunk_end[-1:]


# (bag lengths, F * B of them; ids in order; row_offsets, one per feature; chunk)
NUMBERINGS = {
    "empty-bags": ([2, 0, 0, 1, 0, 3, 0, 2], [3, 1, 4, 1, 5, 9, 2, 6], [0, 10], 4),
    "first-bag-empty": ([0, 3, 2], [7, 7, 1, 7, 0], [0], 2),
    "all-in-one-bag": ([0, 0, 9, 0], [2, 5, 2, 2, 0, 5, 2, 1, 2], [0, 8], 3),
    # Features 0 and 2 share a table (one row offset): their ids of one row share a key.
    "features-sharing-a-table": ([1, 2, 0, 3, 1, 1], [4, 0, 4, 1, 4, 2, 4, 0], [0, 5, 0], 64),
    # Sorted, rows of 2, 6 and 5 ids at chunk 4: a chunk starts inside the second row (4), at
    # its end where the third starts (8), and at the third's last id (12).
    "chunks-inside-and-at-ends-of-rows": ([13], [2, 0, 1, 1, 2, 1, 2, 0, 1, 1, 2, 1, 2], [0], 4),
}


@pytest.mark.parametrize("int32_keys", [True, False])
@pytest.mark.parametrize("ids", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", sorted(NUMBERINGS))
def test_number_chunks_is_torchs_numbering(
    case: str, ids: torch.dtype, int32_keys: bool, device: torch.device
) -> None:
    lengths, in_order, row_offsets, chunk = NUMBERINGS[case]
    batch = len(lengths) // len(row_offsets)
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0).to(ids)
    indices = torch.tensor(in_order, dtype=ids, device=device)
    r_off = torch.tensor(row_offsets, device=device)
    got = numbering.number_chunks(r_off, indices, offsets, batch, chunk, int32_keys=int32_keys)
    want = _numbering_by_torch(r_off, indices, offsets, batch, chunk, int32_keys)
    assert got[0].dtype == torch.int32 and got[1].dtype == (torch.int32 if int32_keys else torch.int64)
    for name, g, w in zip(("bag", "sorted_keys", "order", "starts", "count"), got, want, strict=True):
        assert torch.equal(g.long(), w.long()), (name, g, w)


def test_number_chunks_spans_programs(device: torch.device) -> None:
    """Ids over several programs' positions (1024 each), hot rows crossing their edges, and
    bags of all lengths (empty ones among them)."""
    gen = torch.Generator(device=device).manual_seed(0)
    lengths = torch.randint(0, 40, (2 * 60,), generator=gen, device=device)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), lengths.cumsum(0)])
    indices = torch.randint(0, 30, (int(lengths.sum()),), generator=gen, device=device)
    indices[::3] = 7  # one row in a third of the ids
    r_off = torch.tensor([0, 30], device=device)
    got = numbering.number_chunks(r_off, indices, offsets, 60, 16, int32_keys=True)
    want = _numbering_by_torch(r_off, indices, offsets, 60, 16, True)
    assert indices.numel() > 2 * 1024
    for name, g, w in zip(("bag", "sorted_keys", "order", "starts", "count"), got, want, strict=True):
        assert torch.equal(g.long(), w.long()), name


@pytest.mark.parametrize("case", ["mixed", "one-long-bag", "empty-runs"])
def test_bags_of_carries_bags_across_blocks(case: str, device: torch.device) -> None:
    """Each id's bag (the kit's marks of bag starts and their running maximum over blocks of
    2048 ids, interpreted on a CPU too) against a search: bags of every length, one bag over
    several blocks among thousands of empty ones, and runs of empty bags at block edges."""
    gen = torch.Generator(device=device).manual_seed(1)
    if case == "mixed":
        lengths = torch.randint(0, 12, (1500,), generator=gen, device=device)
    elif case == "one-long-bag":
        lengths = torch.zeros(5000, dtype=torch.int64, device=device)
        lengths[2500] = 3 * 2048 + 5
    else:  # 700 empty bags at each of the block edges 2048 and 4096, then bags of 0 to 3 ids
        one, empty = torch.ones(2048, dtype=torch.int64), torch.zeros(700, dtype=torch.int64)
        rest = torch.randint(0, 4, (1500,), generator=torch.Generator().manual_seed(1))
        lengths = torch.cat([one, empty, one, empty, rest]).to(device)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), lengths.cumsum(0)])
    nnz = int(offsets[-1])
    assert nnz > 2 * 2048
    positions = torch.arange(nnz, device=device)
    want = torch.searchsorted(offsets[1:], positions, right=True)
    # The kernels (which a CPU interprets), and what the op runs here (a search on a CPU).
    for got in (numbering.bags_of(offsets, nnz, kernels=True), numbering.bags_of(offsets, nnz)):
        assert got.dtype == torch.int32 and torch.equal(got.long(), want)


def test_bag_marks_stay_within_the_ids_whatever_the_offsets(device: torch.device) -> None:
    """The update's op does not read offsets to check them (no sync): marks of bags that start
    at or past nnz (offsets running past it, or negative) are not written, so a buffer of nnz
    is never written past. Here the buffer has room past nnz, which must stay as it was."""
    offsets = torch.tensor([0, 2, 3, 7, 9, 12, 12, 40], device=device)  # nnz 3: bags 3 on past it
    nnz, guard = 3, torch.full((64,), -7, dtype=torch.int32, device=device)
    numbering._bag_starts_kernel[(1,)](offsets, guard, nnz, offsets.numel() - 1, BLOCK=1024)
    assert guard[:nnz].tolist() == [0, -7, 1]
    assert (guard[nnz:] == -7).all()
    negative = torch.tensor([0, 1, -5, 2], device=device)
    guard.fill_(-7)
    numbering._bag_starts_kernel[(1,)](negative, guard, 2, 3, BLOCK=1024)
    assert guard[:2].tolist() == [0, -7] and (guard[2:] == -7).all()


def test_the_chunk_scan_carries_across_its_tiles(device: torch.device) -> None:
    """The one-program prefix sum over blocks' counts, in tiles of 16 here (1024 in the op)."""
    counts = torch.randint(0, 1000, (53,), device=device)
    scanned = counts.clone()
    total = torch.empty(1, dtype=torch.int64, device=device)
    numbering._scan_kernel[(1,)](scanned, total, counts.numel(), BLOCK=16)
    assert torch.equal(scanned, counts.cumsum(0) - counts)
    assert total.tolist() == [int(counts.sum())]


def _several_steps(
    update, shape: Shape, steps: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = PROBLEM.make_inputs(shape, 7, device)
    weights, state = inputs.args[0], inputs.args[1]
    for step in range(steps):
        fresh = PROBLEM.make_inputs(shape, 100 + step, device)  # new ids and gradients each step
        update(weights, state, *fresh.args[2:], **fresh.kwargs)
    return weights, state


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_several_steps_match_the_reference_and_torchs_sparse_path(
    optimizer: str, device: torch.device
) -> None:
    shape = _hot(optimizer)
    ours = _several_steps(ops.embedding_bags_update, shape, 3, device)
    theirs = _several_steps(reference, shape, 3, device)
    sparse = _several_steps(torch_sparse_update, shape, 3, device)
    for got in (ours, sparse):
        torch.testing.assert_close(got[0], theirs[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], theirs[1], atol=1e-5, rtol=1e-5)
    assert not torch.equal(ours[0], PROBLEM.make_inputs(shape, 7, device).args[0])


@pytest.mark.slow
def test_stochastic_rounding_is_unbiased(device: torch.device) -> None:
    """An sgd step that lands a quarter of the way between two bf16 values, on 30 rows of 32 at
    each of five seeds: rounded to nearest it never moves; stochastically, its mean over the
    draws is the exact fp32 result."""
    rows, steps = 30, 5
    weights0 = torch.full(((rows + 4) * 32,), 1.0, dtype=torch.bfloat16, device=device)
    ulp = 2.0**-7  # bf16's spacing just below 2, above 1
    grad_out = torch.full((rows, 32), -0.25 * ulp / 0.5, dtype=torch.bfloat16, device=device)
    meta = [torch.tensor(v, device=device) for v in ([0], [0], [0, 32])]
    indices = torch.arange(rows, device=device)  # bag b holds row b, once
    offsets = torch.arange(rows + 1, device=device)

    def step(weights: torch.Tensor, **rounding) -> None:
        args = (torch.zeros(0, device=device), grad_out, *meta, indices, offsets)
        ops.embedding_bags_update(weights, *args, max_dim=32, optimizer="sgd", lr=0.5, **rounding)

    rounded = []
    for seed in range(steps):
        weights = weights0.clone()
        step(weights, stochastic_rounding=True, seed=seed)
        drawn = weights[: rows * 32].float().view(rows, 32)
        assert set(drawn.flatten().tolist()) <= {1.0, 1.0 + ulp}
        rounded.append(drawn)
        assert torch.equal(weights[rows * 32 :], weights0[rows * 32 :])  # other rows untouched
    assert not torch.equal(rounded[0], rounded[1])  # another seed, other draws
    mean = torch.cat(rounded).mean().item()
    exact = 1.0 + 0.25 * ulp
    # 4800 Bernoulli(1/4) draws in units of ulp: a standard error of 0.00625 ulp.
    assert abs(mean - exact) < 0.04 * ulp, (mean, exact)
    # Each element its own draw: two independent draws agree with probability 1/16 + 9/16 =
    # 0.625, over 4650 neighbour pairs give or take 0.007; one draw shared by four neighbours (a
    # generator call spread too thin) would agree in 24 pairs of 31. Likewise down a column (a
    # draw shared by rows).
    up = torch.cat(rounded) > 1.0
    for agree in ((up[:, 1:] == up[:, :-1]).float().mean(), (up[1:] == up[:-1]).float().mean()):
        assert abs(agree.item() - 0.625) < 0.05, agree
    nearest = weights0.clone()
    step(nearest)
    assert torch.equal(nearest, weights0)


def test_rounding_bounds_take_in_the_far_side_of_a_power_of_two_but_rarely() -> None:
    """An exact fp32 step just below 2.0 that another summation order puts just above it: an
    honest fp16 rounding gives 2.0 + 2^-9, more than one spacing below 2.0 (2^-10) away; two
    values up or down lies outside. Such a rounding is rare (the slack over the gap): a step
    exactly on a value of the dtype may move a value either way only as rarely. Away from both,
    only the two neighbours pass, and never beyond them."""
    before = torch.tensor([2.25, 1.5, 1.25])
    exact = torch.tensor([2.0 - 2.0**-22, 1.5 - 2.0**-12, 1.0])
    lowest, highest, chance = rounding_bounds(exact, before, torch.float16)
    assert lowest.tolist() == [2.0 - 2.0**-10, 1.5 - 2.0**-10, 1.0 - 2.0**-11]
    assert highest.tolist() == [2.0 + 2.0**-9, 1.5, 1.0 + 2.0**-10]
    slack = (before.abs() + (before - exact).abs()) * 2**-20
    assert chance[0] == pytest.approx(float(slack[0]) / 2.0**-9) and chance[1] == 0.0
    assert chance[2] == pytest.approx(float(slack[2]) * (2.0**11 + 2.0**10))
    assert float(chance.max()) < 5e-3  # a few in a thousand at most


def test_a_deterministic_move_off_exact_steps_is_refused() -> None:
    """SGD steps that land exactly on a bf16 value: an honest stochastic rounding keeps them (all
    but a rare one, from fp32's slack); moving each one value away, in either direction, lies
    within the bounds of each weight alone but is refused by the count."""
    from search_space.embedding_bags_update import verify

    weights = torch.full((64 * 16,), 1.0, dtype=torch.bfloat16)
    step = 2.0**-7  # bf16's spacing in [1, 2): the step lands on 1 - 2^-7 exactly
    grad_out = torch.full((64, 16), step, dtype=torch.bfloat16)
    args = (
        weights,
        torch.zeros(0),
        grad_out,
        torch.tensor([0]),
        torch.tensor([0]),
        torch.tensor([0, 16]),
        torch.arange(64),
        torch.arange(65),
    )
    inputs = Inputs(
        args=args, kwargs={"max_dim": 16, "optimizer": "sgd", "lr": 1.0, "stochastic_rounding": True}
    )
    exact = weights.float() - step
    assert verify(inputs, (exact.to(torch.bfloat16), torch.zeros(0))) is None
    for moved in (exact - 2.0**-8, exact + 2.0**-8):  # a value down, a value up (spacing 2^-8 below 1)
        message = verify(inputs, (moved.to(torch.bfloat16), torch.zeros(0)))
        assert message is not None and "beyond the two values" in message, message


def test_the_custom_op_says_what_it_updates_and_compiles(device: torch.device) -> None:
    schema = str(ops.embedding_bags_update.custom_op._opoverload._schema)
    assert "Tensor(a0!) weights" in schema and "Tensor(a1!) state" in schema and schema.endswith("-> ()")
    inputs = PROBLEM.make_inputs(_hot("adagrad"), 3, device)
    eager, compiled_inputs = inputs.clone(), inputs.clone()
    ops.embedding_bags_update(*eager.args, **eager.kwargs)

    def step(*args, **kwargs):
        ops.embedding_bags_update(*args, **kwargs)

    torch.compile(step, backend="aot_eager", fullgraph=True)(*compiled_inputs.args, **compiled_inputs.kwargs)
    torch.testing.assert_close(compiled_inputs.args[0], eager.args[0])
    torch.testing.assert_close(compiled_inputs.args[1], eager.args[1])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(optimizer="adam"), "optimizer must be"),
        (dict(pooling="max"), "pooling must be"),
        (dict(max_dim=0), "max_dim must be"),
        (dict(pooling="mean", per_sample_weights="psw"), "only supported with pooling='sum'"),
        (dict(stochastic_rounding=True), "bf16 and fp16"),
        (dict(offsets="odd"), "offsets must be"),
        (dict(grad_out="short"), "grad_out must be"),
        (dict(state="fp16"), "state must be"),
    ],
)
def test_bad_arguments_are_named(change: dict, match: str, device: torch.device) -> None:
    inputs = PROBLEM.make_inputs(_hot("adagrad"), 0, device)
    weights, state, grad_out, w_off, r_off, d_off, indices, offsets = inputs.args
    kwargs = {**inputs.kwargs, **change}
    if change.get("per_sample_weights") == "psw":
        kwargs["per_sample_weights"] = torch.ones(indices.shape, device=device)
    if change.get("offsets") == "odd":
        offsets = offsets[:-1]
    if change.get("grad_out") == "short":
        grad_out = grad_out[:-1]
    if change.get("state") == "fp16":
        state = state.half()
    kwargs = {k: v for k, v in kwargs.items() if k not in ("offsets", "grad_out", "state")}
    with pytest.raises(ValueError, match=match):
        ops.embedding_bags_update(weights, state, grad_out, w_off, r_off, d_off, indices, offsets, **kwargs)


@pytest.mark.skipif(isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}")
@pytest.mark.slow
def test_the_sandbox_accepts_the_default_and_refuses_skipped_rows_and_host_updates(tmp_path) -> None:
    backend = LocalBackend(timeout_s=240, scratch_root=tmp_path)
    template = get_template("embedding_bags_update")
    source = template.render({})
    # Checked only: its timed calls are checked by the adversarial suite's timed cases
    # (tests/sandbox/test_adversarial_updates.py), and the suite's time is short.
    result = backend.evaluate(
        Candidate(problem=PROBLEM.name, source=source, entry=template.entry), timing=False
    )
    assert result.status == Status.OK, f"{result.message}\n{result.log_tail}"
    # The hot rows' pass left out: their rows never change.
    launch = "    _long_rows_kernel[(triton.cdiv(nnz, chunk),)]("
    assert launch in source
    skipped = source.replace(launch, "    (lambda *a, **k: None)(")
    result = backend.evaluate(
        Candidate(problem=PROBLEM.name, source=skipped, entry=template.entry), timing=False
    )
    assert result.status == Status.WRONG, result.message
    # The step made by host code on the weights: refused however right it is.
    host = source.replace(
        "    grad_out = grad_out.contiguous()\n",
        "    grad_out = grad_out.contiguous()\n    weights.mul_(1.0)\n",
    )
    assert host != source
    result = backend.evaluate(
        Candidate(problem=PROBLEM.name, source=host, entry=template.entry), timing=False
    )
    assert result.status in (Status.SUSPICIOUS, Status.STATIC_REJECTED), result.message


def test_an_update_that_returns_something_is_wrong(device: torch.device) -> None:
    """The contract is in place: a kernel that returns the new weights instead is wrong, even
    where it also updated them."""

    def returns_weights(weights, *args, **kwargs):
        kernel.embedding_bags_update(weights, *args, **kwargs)
        return weights

    result = check_shape(PROBLEM, returns_weights, _hot("sgd"), 0, device)
    assert not result.ok and "returns None" in result.message


# Every launch compiled for an H100/H200 with Triton's real compiler, in the GPU's launch
# configuration (tests/kernels/cuda_compile.py compiles what a launcher picks for DEVICE tensors:
# here the interpreter's few wide programs).
COMPILE_GPU_LAUNCHES = """
import functools
import json
import cuda_compile
import kernels.embedding_bags_update as module
import kernels.kit.embeddings as kit
config = module._config
module._config = lambda max_dim, interpreted=False: config(max_dim, False)
kit.bags_of = functools.partial(kit.bags_of, kernels=True)  # a GPU's bags, not a CPU's search
first = cuda_compile.main(["embedding_bags_update"])
# The int64 keys and places of buffers of 2^31 rows or elements or more: in bf16 alone, whose
# check shapes take every path (both optimizers, scaled and stochastic), since the types are all
# that changes.
module.INT32_KEYS_BELOW = 0
module.INT32_PLACES_BELOW = 0
then = cuda_compile.main(["embedding_bags_update"], dtypes=("bf16",))
print(json.dumps({"compiled": first["compiled"], "failed": first["failed"] + then["failed"]}))
"""


@pytest.mark.slow
def test_every_gpu_launch_compiles_for_sm90() -> None:
    report = in_subprocess(COMPILE_GPU_LAUNCHES)
    assert report["failed"] == [], report["failed"]
    assert report["compiled"] == [
        *(
            f"kernels.embedding_bags_update.{k}"
            for k in ("_long_rows_kernel", "_rows_kernel", "_sorted_kernel")
        ),
        *(
            f"kernels.kit.embeddings.{k}"
            for k in ("_bag_starts_kernel", "_bags_kernel", "_chunks_kernel", "_scan_kernel")
        ),
    ]


ROWS_REGISTERS = """
import json
import kernels.embedding_bags_update as module
from evals.studies.registers import UPDATE_TYPES, aligned_only, compile_report

aligned = aligned_only(module)  # every row in vectors
cfg = module._config(256, interpreted=False)
tile = dict(BLOCK_I=cfg["BLOCK_I"], BLOCK_L=cfg["BLOCK_L"], BLOCK_D=cfg["BLOCK_D"])
tile["SLICE_D"] = max(cfg["BLOCK_D"] // 4, 1)  # as the launch's
report = {}
for dtype, vec in (("bf16", 8), ("fp32", 4)):
    types = UPDATE_TYPES | {"weights_ptr": "*" + dtype, "grad_out_ptr": "*" + dtype}
    for adagrad in (True, False):
        flags = dict(ADAGRAD=adagrad, SCALED=True, STOCHASTIC=dtype == "bf16", CHUNK=64, VEC=vec)
        flags["HALF"] = vec // 2 if dtype == "bf16" else 1  # as the launch's
        report[f"{dtype} {'adagrad' if adagrad else 'sgd'}"] = [
            compile_report(m._rows_kernel, types, {**flags, **tile}, cfg["num_warps"])[:2]
            for m in (module, aligned)
        ]
print(json.dumps(report))
"""


@pytest.mark.slow
def test_the_misaligned_path_costs_the_rows_kernel_no_registers() -> None:
    """A kernel holds the registers of its costlier path: the rows kernel's misaligned rows (an
    element at a time) took a third more than its aligned rows at the default tile (96 against
    72 a thread, bf16 adagrad, Triton 3.9), and so every call held fewer programs an SM. A quarter of the
    tile's columns at a time, they take about as many: the kernel's registers (ptxas, sm_90) are
    within 8 of the same kernel's without that path, and it spills no more."""
    report = in_subprocess(ROWS_REGISTERS)
    assert len(report) == 4, report
    for flags, ((regs, spill), (aligned_regs, aligned_spill)) in report.items():
        assert regs <= aligned_regs + 8 and spill <= aligned_spill, (flags, report)


@pytest.mark.parametrize(("version", "cap"), [("3.6.0", 48), ("3.9.0", None), ("3.60.0", None)])
def test_register_caps_hold_under_the_triton_they_were_measured_with(version, cap, monkeypatch) -> None:
    """A register cap is a measurement of one compiler's allocation (the kit's register_cap):
    under another Triton, which allocates otherwise and would spill under it, the launch has no
    cap, and the rows kernel's launch parameters say so."""
    monkeypatch.setattr(numbering.triton, "__version__", version)
    assert numbering.register_cap(48) == cap
    assert kernel._config(256, interpreted=False)["maxnreg"] == cap
    assert kernel._config(256, interpreted=True)["maxnreg"] is None
