"""The GEM-class model: the request-oriented path scores as the naive one does while doing the
user's work once per request, trains on the library's kernels as on the reference ops, compiles,
counts its FLOPs right, and follows the kernel library when it changes."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import Counter

import pytest
import torch
from batches import VARIANTS
from torch.utils.flop_counter import FlopCounterMode

from kernels.registry import ARCH_INTERPRETER, DISPATCHER, KernelLibrary, device_arch
from kernels.trace import trace
from model.config import ModelConfig, config_from_dict
from model.data import RequestBatch, TrafficGenerator
from model.flops import BatchSizes, forward_flops
from model.gem import GEMModel
from model.metrics import auc
from model.optim import RowWiseAdagrad
from model.serving import score, top_k_per_request
from search_space import embedding_bags as eb_problem


def _config(name: str = "target-silu") -> ModelConfig:
    return config_from_dict({"size": "tiny", **VARIANTS[name]})


def _model(config: ModelConfig, device: torch.device) -> GEMModel:
    torch.manual_seed(0)
    return GEMModel(config, device=device)


def _batch(config: ModelConfig, device: torch.device, requests: int = 3, index: int = 0) -> RequestBatch:
    return TrafficGenerator(config, seed=1).batch(index, num_requests=requests).to(device)


def _same_scores(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> None:
    """Scores of one batch computed in two layouts: equal to fp32 rounding on a CPU; on a GPU
    serving runs in bf16 autocast, whose products the two layouts may tile differently."""
    tol = 1e-5 if device.type == "cpu" else 2e-2
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.fixture
def references():
    with DISPATCHER.references_only():
        yield


@pytest.mark.usefixtures("references")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_request_path_scores_as_the_naive_path(variant: str, device: torch.device) -> None:
    config = _config(variant)
    model, batch = _model(config, device), _batch(config, device, requests=4)
    with torch.no_grad():  # a bias that matters
        for layer in model.history.layers:
            layer.rel_bias.normal_()
    request, naive = score(model, batch), score(model, batch, naive=True)
    assert request.shape == (batch.num_candidates, 2)
    _same_scores(request, naive, device)


def test_the_request_path_scores_as_the_naive_path_on_the_librarys_kernels(device: torch.device) -> None:
    config = _config()
    model, batch = _model(config, device), _batch(config, device, requests=2)
    before = DISPATCHER.calls.copy()
    request, naive = score(model, batch), score(model, batch, naive=True)
    assert {impl for _, impl in DISPATCHER.calls - before} == {"default"}
    _same_scores(request, naive, device)


@pytest.mark.usefixtures("references")
def test_the_users_work_is_done_once_per_request(device: torch.device) -> None:
    """Counted by hooks on the modules that do it: the history encoder's sequences and tokens,
    and the user features' bags."""
    config = _config()
    model, batch = _model(config, device), _batch(config, device, requests=3)
    seen: Counter[str] = Counter()

    def on_history(module, args, output) -> None:
        seen["sequences"] += args[0].num_requests
        seen["tokens"] += args[1].shape[0]

    def on_sparse(module, args, output) -> None:
        seen[f"{args[1]} bags"] += args[2]

    hooks = [model.history.register_forward_hook(on_history), model.sparse.register_forward_hook(on_sparse)]
    try:
        score(model, batch)
        request = seen.copy()
        seen.clear()
        score(model, batch, naive=True)
        naive = seen.copy()
    finally:
        for hook in hooks:
            hook.remove()
    tokens = batch.history_offsets.diff()
    assert request == Counter(
        {"sequences": 3, "tokens": int(tokens.sum()), "user bags": 3, "item bags": batch.num_candidates}
    )
    copies = int(tokens[batch.cand_to_request].sum())
    assert naive == Counter(
        {"sequences": batch.num_candidates, "tokens": copies, "user bags": batch.num_candidates,
         "item bags": batch.num_candidates}
    )  # fmt: skip


@pytest.mark.parametrize("variant", ["target-silu", "experts"])
@pytest.mark.slow
def test_training_on_the_librarys_kernels_matches_the_reference_ops(
    variant: str, device: torch.device
) -> None:
    """Two steps of the same model on the default kernels and on the references: losses and
    every parameter after them agree. (Plain SGD for the dense part: Adam's first steps are
    about lr x sign(gradient), which turns a rounding difference in a near-zero gradient into
    a whole step.)"""
    config = _config(variant)
    model = _model(config, device)
    twin = copy.deepcopy(model)
    batches = [_batch(config, device, requests=2, index=i) for i in range(2)]

    def train(m: GEMModel) -> list[float]:
        dense = torch.optim.SGD(m.dense_parameters(), lr=0.1)  # the tables' backward steps them
        losses = []
        for batch in batches:
            dense.zero_grad()
            loss, _ = m.loss(batch)
            loss.backward()
            dense.step()
            losses.append(loss.item())
        return losses

    before = DISPATCHER.calls.copy()
    kernels = train(model)
    ran = {op for op, impl in DISPATCHER.calls - before if impl == "default"}
    assert {
        "embedding_bags",
        "embedding_bags_update",
        "jagged_attention",
        "target_attention",
        "jagged_attention_grad",
        "layer_norm_gate",
        "layer_norm_gate_grad",
        "wukong_fm",
    } <= ran
    if config.heads.num_experts:
        assert {"grouped_gemm", "grouped_gemm_weight_grad"} <= ran
    with DISPATCHER.references_only():
        reference = train(twin)
    assert kernels == pytest.approx(reference, rel=1e-4)
    # Every parameter, and the tables and their optimizer's state (buffers: their backward steps them).
    mine, theirs = model.state_dict(), twin.state_dict()
    assert (
        mine.keys() == theirs.keys()
        and {"sparse.embeddings.weights", "sparse.embeddings.state"} <= mine.keys()
    )
    for name, got in mine.items():
        torch.testing.assert_close(got, theirs[name], atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.usefixtures("references")
def test_the_compiled_model_scores_as_the_eager_one(device: torch.device) -> None:
    config = _config("experts")
    model, batch = _model(config, device), _batch(config, device)
    model.eval()
    # aot_eager traces what inductor would (dynamo, fake kernels, functionalization) without
    # its C++ code generation, which costs tens of seconds cold on a CPU.
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        eager, traced = model(batch).logits, compiled(batch).logits
    torch.testing.assert_close(traced, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("references")
def test_the_analytic_flops_are_the_matrix_products_counted() -> None:
    """Without a history every matrix product but the experts' and the Wukong blocks' is torch's,
    so torch's counter must find exactly the analytic count of the rest (pooling sums are not
    matrix products, and not counted by it)."""
    config = config_from_dict({"size": "tiny", "history": None, "heads": VARIANTS["experts"]["heads"]})
    model, batch = _model(config, torch.device("cpu")), _batch(config, torch.device("cpu"), requests=5)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(batch)
    with trace() as recorded, torch.no_grad():
        model(batch)
    analytic = forward_flops(config, BatchSizes.of(batch))
    matmul = sum(v for k, v in analytic.items() if k.endswith(".matmul"))
    assert counter.get_total_flops() == matmul
    # The experts and the Wukong blocks run as library ops, which torch's counter does not see
    # into: their declared costs are the analytic counts.
    assert sum(c.flops for c in recorded.calls if c.op == "grouped_gemm") == analytic["heads.experts"]
    assert sum(c.flops for c in recorded.calls if c.op == "wukong_fm") == analytic["interaction.fm"]
    assert analytic["embeddings.pooling"] == sum(
        bags.ids.numel() * config.table(f.table).dim
        for f in config.features
        for bags in [(batch.user_features | batch.item_features)[f.name]]
    )


@pytest.mark.usefixtures("references")
def test_the_attention_flops_are_the_ops_declared_costs() -> None:
    """With a history, the analytic attention FLOPs are what the attention ops' declared costs
    add up to on the calls the model makes."""
    for name in ("target-silu", "targets-gdpa-softmax"):
        config = _config(name)
        model, batch = _model(config, torch.device("cpu")), _batch(config, torch.device("cpu"), requests=4)
        with trace() as recorded, torch.no_grad():
            model(batch)
        calls = {c.op: c.flops for c in recorded.calls if "attention" in c.op or c.op == "gdpa"}
        h = config.history
        analytic = forward_flops(config, BatchSizes.of(batch, candidates_as_targets=h.candidates_as_targets))
        scoring_op = "gdpa" if config.scoring.attention == "gdpa" else "target_attention"
        assert calls["jagged_attention"] * h.num_layers == analytic["history.attention"]
        assert calls[scoring_op] == analytic["scoring.attention"]


ON_A_GPU = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="interpreted, 30 s; what it checks is a GPU's"
)


@pytest.mark.parametrize(
    "references", [True, pytest.param(False, marks=ON_A_GPU)], ids=["references", "kernels"]
)
@pytest.mark.slow
def test_the_profile_lists_every_op_a_step_calls(device: torch.device, references: bool) -> None:
    """On the references and on the default kernels (whose launches, on a GPU, the profiler
    credits to the library's ranges, not again to the autograd Function around them)."""
    from model.profile import IDLE, TORCH, profile_model

    config = _config("targets-gdpa-softmax")
    only = DISPATCHER.references_only() if references else contextlib.nullcontext()
    with only, warnings.catch_warnings():
        warnings.simplefilter("error")  # rows that count some time twice warn
        profile = profile_model(config, "train", device, steps=1, warmup=0)
    expected = {
        "embedding_bags", "embedding_bags_update", "history_gather", "jagged_attention",
        "jagged_attention_grad", "gdpa", "gdpa_grad", "jagged_concat", "jagged_split", "wukong_fm",
        "layer_norm_gate", "layer_norm_gate_grad",
    }  # fmt: skip
    assert set(profile.ops) == expected
    # The rest of the step by the torch op that ran it: the dense layers' matrix products, forward
    # and backward, and the optimizer's step among them; and what no op took.
    torch_rows = {r.op.removeprefix(TORCH): r for r in profile.rows if r.op.startswith(TORCH)}
    assert {"aten::linear", "AdamW.step"} <= set(torch_rows), sorted(torch_rows)
    assert any(name.endswith("Backward0") for name in torch_rows), sorted(torch_rows)
    assert all(r.calls > 0 and r.ms > 0 and not r.implementations for r in torch_rows.values())
    [idle] = [r for r in profile.rows if r.op == IDLE]
    assert idle.ms >= 0
    assert sum(r.ms for r in profile.rows) == pytest.approx(profile.step_ms, rel=1e-6) or idle.ms == 0

    for row in profile.rows:
        if row.implementations:
            assert row.calls >= 1 and row.ms >= 0 and row.gflops is not None and row.mbytes > 0, row


@pytest.mark.slow
def test_a_registered_kernel_replaces_the_default_in_training_and_serving(
    empty_library: KernelLibrary, device: torch.device
) -> None:
    config = _config()
    model, batch = _model(config, device), _batch(config, device, requests=2)
    with trace() as recorded:
        model.loss(batch)[0].backward()
    buckets = sorted({c.bucket for c in recorded.calls if c.op == "embedding_bags"})
    arch = device_arch(device)
    source = eb_problem.TEMPLATE.render({"BLOCK_D": 16, "BLOCK_L": 8, "BLOCK_B": 2, "ACC_3D": True})
    entry = empty_library.add(
        op="embedding_bags",
        entry=eb_problem.TEMPLATE.entry,
        source=source,
        arch=arch,
        dtype="fp32",
        buckets=buckets,
        median_us=None,
        interpreted=arch == ARCH_INTERPRETER,
        evidence={},
        provenance={"test": "gem registered kernel"},
    )
    name = f"library:{entry.kernel_id}"
    probabilities = score(model, batch)
    with trace() as served:
        again = score(model, batch)
    assert {c.implementation for c in served.calls if c.op == "embedding_bags"} == {name}
    torch.testing.assert_close(again, probabilities, atol=1e-6, rtol=1e-5)
    with trace() as trained:
        model.loss(batch)[0].backward()
    assert {c.implementation for c in trained.calls if c.op == "embedding_bags"} == {name}


def test_row_wise_adagrad_updates_the_rows_looked_up_and_no_other() -> None:
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(10, 4))
    before = table.detach().clone()
    optimizer = RowWiseAdagrad([table], lr=0.5, eps=1e-8)
    grad = torch.zeros(10, 4)
    grad[[2, 7]] = torch.randn(2, 4)
    for _ in range(2):
        table.grad = grad.clone()
        optimizer.step()
    state = 2 * grad.pow(2).mean(1)
    first = before - 0.5 * grad / (grad.pow(2).mean(1).sqrt() + 1e-8).unsqueeze(1)
    expected = first - 0.5 * grad / (state.sqrt() + 1e-8).unsqueeze(1)
    expected[[0, 1, 3, 4, 5, 6, 8, 9]] = before[[0, 1, 3, 4, 5, 6, 8, 9]]
    torch.testing.assert_close(table.detach(), expected)
    sparse = torch.nn.Parameter(before.clone())
    sparse_optimizer = RowWiseAdagrad([sparse], lr=0.5, eps=1e-8)
    for form in (grad.to_sparse(sparse_dim=1), grad.to_sparse()):  # row-sparse, element-sparse
        sparse.grad = form
        sparse_optimizer.step()
    torch.testing.assert_close(sparse.detach(), expected)


def test_auc_is_the_probability_a_positive_outranks_a_negative() -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (60,), generator=gen).float()  # many ties
    labels = torch.bernoulli(torch.full((60,), 0.4), generator=gen)
    pos, neg = scores[labels == 1], scores[labels == 0]
    brute = ((pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()).mean()
    assert auc(scores, labels) == pytest.approx(float(brute))
    assert auc(scores, torch.ones(60)) != auc(scores, torch.ones(60))  # NaN without negatives


def test_top_k_per_request_leaves_slots_it_cannot_fill() -> None:
    scores = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7])
    offsets = torch.tensor([0, 3, 3, 5])  # requests of 3, 0 and 2 candidates
    values, rows = top_k_per_request(scores, offsets, 3, max_candidates=3)
    assert rows.tolist() == [[1, 2, 0], [-1, -1, -1], [4, 3, -1]]
    assert values[0].tolist() == pytest.approx([0.9, 0.5, 0.1])
    with pytest.raises(ValueError, match="k must be >= 1"):
        top_k_per_request(scores, offsets, 0, max_candidates=3)


@pytest.mark.usefixtures("references")
@pytest.mark.parametrize("variant", ["target-silu", "targets-gdpa-softmax"])
def test_a_training_step_reaches_every_parameter(variant: str, device: torch.device) -> None:
    config = _config(variant)
    model, batch = _model(config, device), _batch(config, device, requests=4)
    model.loss(batch)[0].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"


@pytest.mark.usefixtures("references")
@pytest.mark.parametrize("update", ["fused", "unfused"])
def test_a_training_step_updates_the_rows_looked_up_and_no_other(update: str, device: torch.device) -> None:
    config = _config()
    config.train.embedding_update = update
    model, batch = _model(config, device), _batch(config, device, requests=4)
    before = [model.sparse.table(t.name).detach().clone() for t in config.tables]
    model.loss(batch)[0].backward()
    if update == "unfused":
        layout = model.sparse.embeddings.table_layout()
        optimizer = RowWiseAdagrad([{"params": model.embedding_parameters(), "tables": layout}], lr=0.1)
        optimizer.step()
    looked_up = {t.name: torch.zeros(t.num_rows, dtype=torch.bool, device=device) for t in config.tables}
    for f in config.features:
        bags = (batch.user_features | batch.item_features)[f.name]
        looked_up[f.table][bags.ids % config.hash_size(f)] = True
    looked_up[config.history.item_table][batch.history_items] = True
    for t, old in zip(config.tables, before, strict=True):
        changed = (model.sparse.table(t.name).detach() != old).any(dim=1)
        assert looked_up[t.name].any() and not looked_up[t.name].all(), t.name
        assert torch.equal(changed, looked_up[t.name]), t.name


@pytest.mark.usefixtures("references")
def test_the_first_wukong_layer_computes_the_user_half_once_as_the_whole_layer_would() -> None:
    """The request-oriented split (the user's rows read from the request, its share of the
    linear blocks once per request) equals the layer on every candidate's full, copied input."""
    from model.gem import WukongLayer

    torch.manual_seed(3)
    layer = WukongLayer(7, 16, rank=4, fm_outputs=3, compressed_outputs=2, mlp_dims=[24])
    x_user, x_cand = torch.randn(3, 3, 16), torch.randn(8, 4, 16)
    cand_to_request = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    split = layer(x_cand, x_user, cand_to_request)
    whole = layer(torch.cat([x_user[cand_to_request], x_cand], dim=1))
    assert split.shape == (8, 5, 16)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("references", [True, False], ids=["reference-ops", "library-kernels"])
@pytest.mark.slow
def test_a_training_step_runs_under_bf16_autocast(references: bool) -> None:
    """As a GPU trains (bf16 autocast), here on the CPU: the ops run outside autocast with the
    dtypes they are given, their references and formulas too, and the loss agrees with fp32."""
    import contextlib

    config = _config("targets-gdpa-softmax")
    model, batch = _model(config, torch.device("cpu")), _batch(config, torch.device("cpu"), requests=3)
    ops = DISPATCHER.references_only() if references else contextlib.nullcontext()
    with ops:
        full, _ = model.loss(batch)  # before the backward: it steps the tables
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = model.loss(batch)
        loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert loss.item() == pytest.approx(full.item(), rel=2e-2)


@pytest.mark.usefixtures("references")
def test_models_without_user_features_or_histories_train_and_serve(device: torch.device) -> None:
    tiny = config_from_dict({"size": "tiny"}).to_dict()
    no_user = config_from_dict({**tiny, "features": [f for f in tiny["features"] if f["side"] == "item"]})
    model = _model(no_user, device)
    batch = _batch(no_user, device)
    model.loss(batch)[0].backward()
    assert score(model, batch).shape == (batch.num_candidates, 2)
    # Every history of the batch empty: the encoder sees no token at all.
    config = _config()
    model = _model(config, device)
    empty = TrafficGenerator(config, seed=1).batch(0, num_requests=3, history_length=0).to(device)
    assert empty.history_items.numel() == 0
    model.loss(empty)[0].backward()
    _same_scores(score(model, empty), score(model, empty, naive=True), device)


def test_the_librarys_calls_are_op_scoped_ranges_under_the_profiler(device: torch.device) -> None:
    """A GPU kernel is credited to the innermost op-scoped event around its launch, not to a
    user-scoped range: each library call's range is op-scoped, so its kernels are its own in the
    profile and not counted again under the autograd Function around it."""
    config = _config()
    model, batch = _model(config, device), _batch(config, device, requests=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, trace():
        model.loss(batch)[0].backward()
    scopes = {e.scope for e in prof.events() if e.name.startswith("recforge::") and "::" in e.name[10:]}
    assert scopes == {int(torch._C._profiler.RecordScope.FUNCTION)}
