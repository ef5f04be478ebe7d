"""One rank of a multi-process check (tests/model/test_sharding.py starts WORLD_SIZE of them
with RANK, MASTER_ADDR and MASTER_PORT set, as torchrun would): gloo on CPU processes, or with
WORKER_DEVICE=cuda, NCCL with a GPU a rank (LOCAL_RANK's).

    python tests/model/distributed_worker.py lookup OUT_DIR
    python tests/model/distributed_worker.py train OUT_DIR [balance|contiguous]

lookup: ShardedEmbeddings against TableBatchedEmbeddings holding every table in this process:
each rank's bags of several features (sum and mean, weighted, empty bags, a hot id, ids at the
last row, a batch size of its own), unpooled lookups and history gathers, over two fused
steps. The unsharded module makes every rank's lookups in one backward pass, so its update
sums every rank's gradient of a row, as the sharded one must. Writes rank_<r>.json: the
largest differences seen (outputs, this rank's rows of each table, their optimizer state).

train: the tiny model trained data-parallel (the plain PyTorch references for every op), and
on rank 0 the same steps in one process: rank_<r>.json holds both runs' losses and held-out
AUCs, and the requests each rank trained on in its first step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from model.config import TableConfig
from model.embeddings import TableBatchedEmbeddings
from model.sharding import ShardedEmbeddings, ShardingPlan

TABLES = [
    TableConfig(name="items", num_rows=37, dim=8),
    TableConfig(name="users", num_rows=11, dim=4),
    TableConfig(name="ads", num_rows=23, dim=16),
    TableConfig(name="tiny", num_rows=1, dim=4),
]
FEATURES = ["items", "users", "items", "ads", "tiny"]


def _bags(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s bags at `step`: feature-major offsets over 3 + rank samples, per-sample
    weights, and the seeds of its loss."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    batch = 3 + rank
    ids, lengths = [], []
    for f, name in enumerate(FEATURES):
        rows = TABLES[[t.name for t in TABLES].index(name)].num_rows
        for b in range(batch):
            n = 0 if (f + b) % 4 == 3 else int(torch.randint(1, 5, (1,), generator=gen))
            bag = torch.randint(0, rows, (n,), generator=gen)
            if n and b == 0:
                bag[0] = rows - 1  # the last row
            if n > 1 and b == 1:
                bag[:] = 0  # a hot row, repeated
            ids.append(bag)
            lengths.append(n)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths), 0, out=offsets[1:])
    ids_t = torch.cat(ids)
    weights = torch.rand(ids_t.numel(), generator=gen) + 0.5
    return ids_t, offsets, weights, torch.randn(batch, 1000, generator=gen)


def _device() -> torch.device:
    if os.environ.get("WORKER_DEVICE") == "cuda":
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def _loss(module, rank: int, step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ids, offsets, weights, seeds = (t.to(_device()) for t in _bags(rank, step))
    summed = module(FEATURES, ids, offsets)
    meaned = module(FEATURES, ids, offsets, pooling="mean")
    weighted = module(FEATURES, ids, offsets, per_sample_weights=weights)
    tokens = module.lookup("ads", ids[: 7 + rank] % 23)
    history = module.gather("items", ids % 37, torch.tensor([0, ids.numel()], device=ids.device))
    outs = [summed, meaned, weighted, tokens, history]
    loss = sum((o * seeds.flatten()[: o.numel()].view_as(o)).sum() for o in outs)
    return loss, outs


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, relative to the value's size where that is over 1."""
    if got.shape != want.shape:
        return float("inf")
    return ((got - want).abs() / want.abs().clamp(min=1)).max().item() if want.numel() else 0.0


def lookup(out_dir: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = ShardingPlan.of(TABLES, world, row_wise=["items"])
    torch.manual_seed(0)
    whole = TableBatchedEmbeddings(TABLES, device=_device())
    torch.manual_seed(0)
    sharded = ShardedEmbeddings(TABLES, plan, gradient_divisor=1, device=_device())
    worst = {"outputs": 0.0, "weights": 0.0, "state": 0.0}
    for step in range(2):
        losses, expected = [], []
        for r in range(world):
            loss, outs = _loss(whole, r, step)
            losses.append(loss)
            expected.append(outs)
        sum(losses).backward()
        loss, outs = _loss(sharded, rank, step)
        loss.backward()
        for got, want in zip(outs, expected[rank], strict=True):
            worst["outputs"] = max(worst["outputs"], _relative(got, want))
        for t in TABLES:
            held = sharded.local_table(t.name)
            if held is None:
                continue
            rows, first = held
            want = whole.table(t.name)[first : first + rows.shape[0]]
            worst["weights"] = max(worst["weights"], _relative(rows, want))
            t_index = sharded.local.index[t.name]
            at = sharded.local.layout.table_row_offsets()[t_index]
            state = sharded.local.state[at : at + rows.shape[0]]
            whole_at = whole.layout.table_row_offsets()[whole.index[t.name]] + first
            want_state = whole.state[whole_at : whole_at + rows.shape[0]]
            worst["state"] = max(worst["state"], _relative(state, want_state))
    held = {t.name: sharded.local_table(t.name) is not None for t in TABLES}
    # An id past its table on the last rank only: every rank refuses the call, none waits.
    bad = torch.tensor([0, 1, 37 if rank == world - 1 else 2], device=_device())
    try:
        sharded(["items"], bad, torch.tensor([0, 3], device=_device()))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    report = {"worst": worst, "held": held, "kinds": plan.kinds, "refused": refused}
    report["bf16"] = _bf16_lookups(rank, world)
    report["refusals"] = _refusals(sharded, rank)
    (out_dir / f"rank_{rank}.json").write_text(json.dumps(report))


def _bf16_lookups(rank: int, world: int) -> float:
    """bf16 tables all on rank 0 (the other ranks hold none, and still answer in bf16): the
    largest difference of this rank's lookups from the unsharded tables'."""
    plan = ShardingPlan(world, ("table",) * len(TABLES), (0,) * len(TABLES))
    torch.manual_seed(1)
    whole = TableBatchedEmbeddings(TABLES, dtype=torch.bfloat16, device=_device())
    torch.manual_seed(1)
    sharded = ShardedEmbeddings(TABLES, plan, dtype=torch.bfloat16, device=_device())
    ids, offsets, _, _ = (t.to(_device()) for t in _bags(rank, 0))
    with torch.no_grad():
        pairs = [
            (sharded(FEATURES, ids, offsets), whole(FEATURES, ids, offsets)),
            (sharded.lookup("ads", ids % 23), whole.lookup("ads", ids % 23)),
        ]
    return max(
        _relative(got.float(), want.float()) if got.dtype == torch.bfloat16 else 1.0 for got, want in pairs
    )


def _refusals(sharded: ShardedEmbeddings, rank: int) -> list[str]:
    """Calls that some or every rank makes wrongly: each refused on every rank, none left
    waiting for the others."""
    ids, offsets, weights, _ = (t.to(_device()) for t in _bags(rank, 0))
    calls = [
        lambda: sharded(FEATURES, ids, offsets, per_sample_weights=weights if rank == 0 else None),
        lambda: sharded(FEATURES, ids, offsets, pooling="mean", per_sample_weights=weights),
        lambda: sharded(FEATURES, ids, offsets[:-1] if rank == 0 else offsets),
    ]
    said = []
    for call in calls:
        try:
            call()
            said.append("")
        except ValueError as exc:
            said.append(str(exc))
    return said


def train(out_dir: Path, split: str = "balance") -> None:
    import contextlib

    from kernels.registry import DISPATCHER
    from model.config import config_from_dict
    from model.training import DataParallel, Trainer

    rank, device = dist.get_rank(), _device()
    config = config_from_dict(
        {
            "size": "tiny",
            "data": {"requests_per_batch": 12},
            # Experts: their balancing loss is a product of batch statistics, summed over ranks.
            "heads": {"num_experts": 4, "top_k": 2, "expert_dim": 16, "balance_weight": 0.5},
            "train": {"steps": 4, "eval_every": 4, "eval_batches": 1, "autocast": False},
        }
    )
    # On CPUs the ops' references (the interpreted kernels are slow); on GPUs the kernels.
    ops = DISPATCHER.references_only() if device.type == "cpu" else contextlib.nullcontext()
    with ops:
        parallel = DataParallel.of_group(balance=split == "balance", row_wise=("items",))
        trainer = Trainer(config, device, parallel=parallel)
        first = trainer.traffic.batch(0)
        checkpoint = out_dir / "run.pt"
        report = {
            "losses": [s.loss for s in trainer.fit(log_every=1, checkpoint=checkpoint).steps],
            "auc": trainer.history.evals[-1].auc,
            "requests": len(rank_batch_of(first, parallel)),
            "refusals": _checkpoint_refusals(trainer, checkpoint, parallel),
        }
        if rank == 0:
            alone = Trainer(config, device)
            report["alone_losses"] = [s.loss for s in alone.fit(log_every=1).steps]
            report["alone_auc"] = alone.history.evals[-1].auc
    (out_dir / f"rank_{rank}.json").write_text(json.dumps(report))


def _checkpoint_refusals(trainer, checkpoint: Path, parallel) -> list[str]:
    """What resuming says where one rank's file is of another step (as if the run were killed
    between two ranks' saves), then missing: every rank refuses, none waits for the others."""
    from model.training import Trainer

    said = []
    mine = parallel.checkpoint(checkpoint)
    if parallel.rank == 1:
        state = torch.load(mine, weights_only=False)
        torch.save({**state, "step": state["step"] - 1}, mine)
    dist.barrier()
    for attempt in ("older", "missing"):
        try:
            if Trainer.checkpoint_exists(checkpoint, parallel):
                Trainer.resume(checkpoint, trainer.device, parallel=parallel)
            said.append("")
        except ValueError as exc:
            said.append(str(exc))
        dist.barrier()
        if attempt == "older" and parallel.rank == 1:
            mine.unlink()
        dist.barrier()
    return said


def rank_batch_of(batch, parallel) -> list[int]:
    """The requests of `batch` this rank trains on (by their first candidate's dense features)."""
    from model.balance import rank_batch

    part = rank_batch(batch, parallel.rank, parallel.world, balance=parallel.balance)
    return part.dense[part.candidate_offsets[:-1]].sum(1).tolist()


if __name__ == "__main__":
    if _device().type == "cuda":
        torch.cuda.set_device(_device())
        dist.init_process_group("nccl", device_id=_device())
    else:
        dist.init_process_group("gloo")
    try:
        {"lookup": lookup, "train": train}[sys.argv[1]](Path(sys.argv[2]), *sys.argv[3:])
    finally:
        dist.destroy_process_group()
