"""model.sharding: the placement of tables over ranks, and sharded lookups and fused updates
against the unsharded module, in CPU processes talking through gloo (as torchrun starts them)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.config import TableConfig
from model.embeddings import INIT_BLOCK_ROWS, TableBatchedEmbeddings, TableShard, init_rows
from model.sharding import ROW_WISE, TABLE_WISE, ShardingPlan

WORKER = Path(__file__).with_name("distributed_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, *args: str, timeout: float = 240, device: str = "cpu") -> None:
    """Run the worker as `world` ranks of one group (gloo on CPUs; NCCL, a GPU a rank, with
    device "cuda"); fail with their logs if any fails."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = os.environ | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
            "WORKER_DEVICE": device,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out)
            codes.append(p.returncode)
    finally:
        for p in procs:
            p.kill()
    if any(codes):
        pytest.fail(
            "\n".join(
                f"rank {r} exited {c}:\n{log[-3000:]}"
                for r, (c, log) in enumerate(zip(codes, logs, strict=True))
            )
        )


TABLES = [
    TableConfig(name="big", num_rows=1000, dim=64),
    TableConfig(name="mid", num_rows=400, dim=32),
    TableConfig(name="small", num_rows=300, dim=16),
    TableConfig(name="tiny", num_rows=5, dim=4),
]


def test_the_plan_keeps_small_tables_whole_and_splits_what_would_unbalance_the_ranks() -> None:
    plan = ShardingPlan.of(TABLES, 2)
    assert plan.kinds == (ROW_WISE, TABLE_WISE, TABLE_WISE, TABLE_WISE)
    # The whole tables go largest first onto the rank holding the fewest bytes.
    assert plan.owners == (-1, 0, 1, 1)
    assert ShardingPlan.of(TABLES, 1).kinds == (TABLE_WISE,) * 4
    forced = ShardingPlan.of(TABLES, 2, row_wise=["tiny"])
    assert forced.kinds[3] == ROW_WISE


def test_every_row_is_held_by_exactly_one_rank() -> None:
    for world in (1, 2, 3, 8):
        plan = ShardingPlan.of(TABLES, world, row_wise=["tiny"])  # 5 rows over 8 ranks: some hold none
        for t, table in enumerate(TABLES):
            held = torch.zeros(table.num_rows, dtype=torch.int64)
            for rank in range(world):
                shard = plan.shard(TABLES, t, rank)
                if shard is not None:
                    rows = min(plan.block(table) if plan.kinds[t] == ROW_WISE else table.num_rows,
                               table.num_rows - shard.first_row)  # fmt: skip
                    held[shard.first_row : shard.first_row + rows] += 1
            assert torch.equal(held, torch.ones_like(held)), (world, table.name)


def test_the_plan_refuses_what_it_cannot_place() -> None:
    with pytest.raises(ValueError, match="world must be at least 1"):
        ShardingPlan.of(TABLES, 0)
    with pytest.raises(ValueError, match=r"do not exist: \['nope'\]"):
        ShardingPlan.of(TABLES, 2, row_wise=["nope"])


def test_a_shard_starts_with_the_rows_of_the_whole_table() -> None:
    rows = INIT_BLOCK_ROWS + 100
    whole = torch.empty(rows, 2)
    init_rows(whole, TableShard(3, 0, rows), seed=7)
    part = torch.empty(150, 2)  # across the boundary of two seeds' blocks
    init_rows(part, TableShard(3, INIT_BLOCK_ROWS - 50, rows), seed=7)
    assert torch.equal(part, whole[INIT_BLOCK_ROWS - 50 : INIT_BLOCK_ROWS + 100])
    assert whole.abs().max() <= 1 / rows**0.5
    torch.manual_seed(0)
    a = TableBatchedEmbeddings(TABLES)
    torch.manual_seed(0)
    b = TableBatchedEmbeddings(TABLES)
    assert torch.equal(a.weights, b.weights)


# Three CPU ranks (uneven blocks, a rank without a table); the training test below runs two.
@pytest.mark.parametrize(
    ("world", "device"), [(3, "cpu"), pytest.param(2, "cuda", marks=pytest.mark.two_gpus)]
)
@pytest.mark.slow
def test_sharded_lookups_and_fused_updates_match_the_unsharded_tables(
    tmp_path: Path, world: int, device: str
) -> None:
    run_ranks(world, "lookup", str(tmp_path), device=device)
    reports = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(world)]
    kinds = set(reports[0]["kinds"])
    assert kinds == {ROW_WISE, TABLE_WISE}  # both placements ran
    for table in reports[0]["held"]:  # every table has rows somewhere
        assert any(r["held"][table] for r in reports), table
    for rank, report in enumerate(reports):
        for what, worst in report["worst"].items():
            assert worst < 1e-5, (rank, what, worst)
        mine = 1 if rank == world - 1 else 0
        assert f"outside their tables in a lookup of ['items']: {mine} of this rank's" in report["refused"]
        assert report["bf16"] < 1e-2  # bf16 outputs on every rank, the ranks without tables too
        weighted, mean_weighted, offsets = report["refusals"]
        assert "per_sample_weights on some ranks only" in weighted
        assert "refused by rank(s) [0" in mean_weighted and "only supported with mode='sum'" in mean_weighted
        assert "refused by rank(s) [0]" in offsets


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.two_gpus)])
@pytest.mark.slow
def test_data_parallel_training_takes_the_steps_that_one_process_takes(tmp_path: Path, device: str) -> None:
    """Two ranks, each on its part of every batch (balanced by attention work), the tables
    sharded (one row-wise, the rest placed by size), experts whose balancing loss weighs much:
    the same losses and held-out AUC as one process training on the whole batches, step by
    step (fp32; on GPUs the kernels sum in another order, hence the looser bound there). Their
    checkpoint then refuses to resume where one rank's file is of another step, or missing."""
    run_ranks(2, "train", str(tmp_path), device=device)
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    alone = ranks[0]["alone_losses"]
    assert len(alone) == 4 and sum(r["requests"] for r in ranks) == 12
    rel = 1e-5 if device == "cpu" else 1e-3
    for report in ranks:
        assert report["losses"] == pytest.approx(alone, rel=rel)
        assert report["auc"] == pytest.approx(ranks[0]["alone_auc"], abs=rel)
        older, missing = report["refusals"]
        assert "do not make one checkpoint (steps [3, 4]" in older, older
        assert "checkpoint files of rank(s) [1] of 2 are missing" in missing, missing


@pytest.mark.slow
def test_the_command_line_trains_on_two_ranks_and_resumes_them(tmp_path: Path) -> None:
    """`recforge model train --nproc 2` (torchrun, gloo on CPUs): the options reach the ranks,
    a checkpoint per rank, resumed by a run of as many ranks, refused by a run of another
    number (ranks' files of different steps, or missing, are refused in the ranks' own test
    above); a run that cannot be made is refused before any rank starts."""

    def train(*args: str, check: bool = True) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "agent", "model", "train", "--config", "tiny", "--device", "cpu",
               "--reference-ops", *args]  # fmt: skip
        env = os.environ | {"COLUMNS": "200"}
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=240)
        finally:  # torchrun's ranks too, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if check:
            assert proc.returncode == 0, out[-3000:]
        return proc.returncode, out

    ranks = ["--checkpoint", "ranks.pt", "--nproc", "2"]
    train(*ranks, "--steps", "2")
    assert sorted(p.name for p in tmp_path.glob("ranks*.pt")) == [
        "ranks.rank0-of-2.pt",
        "ranks.rank1-of-2.pt",
    ]
    train(*ranks, "--steps", "3", "--resume", "--json", "ranks.json")
    resumed = json.loads((tmp_path / "ranks.json").read_text())
    assert resumed["ranks"] == 2 and [s["step"] for s in resumed["steps"]] == [2, 3]  # step 2 resumed
    code, out = train("--checkpoint", "ranks.pt", "--steps", "4", "--resume", check=False)
    assert code != 0 and "another number of ranks" in out
    code, out = train(*ranks, "--embedding-update", "unfused", check=False)
    assert code == 2 and "fused update only" in out and "torch.distributed" not in out


def test_data_parallel_training_refuses_the_unfused_update() -> None:
    from model.config import config_from_dict
    from model.training import DataParallel, Trainer

    config = config_from_dict({"size": "tiny", "train": {"embedding_update": "unfused"}})
    with pytest.raises(ValueError, match="trained by the fused update only"):
        Trainer(config, parallel=DataParallel(rank=0, world=2))
