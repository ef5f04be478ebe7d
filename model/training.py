"""Training the GEM-class model: AdamW for the dense parameters, row-wise Adagrad for the
embedding tables (fused into their backward by default), bf16 autocast on a GPU, optional
torch.compile, held-out AUC, throughput and MFU, and checkpoints that resume where they stopped.

Data-parallel over the ranks of a `torch.distributed` group (`DataParallel`; `recforge model
train --nproc N` starts them through torchrun): the dense parameters replicated under
DistributedDataParallel, the tables sharded over the ranks (model.sharding). Step i trains on
global batch i, every rank on its part of the requests (balanced by attention work unless told
otherwise: model.balance); each rank's loss is weighted by its share of the candidates, so that
the averaged gradient is the whole batch's, as one process training on it would take (the
experts' load-balancing loss, a product of two batch statistics, sums them over the ranks).

Batch i of a run is a pure function of (seed, i), so a resumed run sees the batches the
uninterrupted one would have. The held-out batches come from the same traffic (indices no
training step reaches). Progress goes to a callback, so that a command line can draw it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from model.balance import rank_batch
from model.config import ModelConfig, config_from_dict
from model.data import Batches, RequestBatch, TrafficGenerator
from model.flops import BatchSizes, by_component, forward_flops, peak_flops, training_flops
from model.gem import GEMModel
from model.metrics import auc, log_loss
from model.optim import RowWiseAdagrad
from model.sharding import FUSED_ONLY_CONFIG, ShardedEmbeddings, Sharding, ShardingPlan

# Held-out batches are drawn from indices no training run reaches.
HELD_OUT_START = 1 << 40


@dataclass
class StepLog:
    step: int
    loss: float
    examples_per_s: float
    model_tflops_per_s: float
    mfu: float | None  # None where the device's peak is unknown (a CPU)


@dataclass
class EvalLog:
    step: int
    auc: dict[str, float]
    log_loss: dict[str, float]


@dataclass
class History:
    steps: list[StepLog] = field(default_factory=list)
    evals: list[EvalLog] = field(default_factory=list)


# What a resumed run may change: how long it trains, how often it evaluates and saves, and
# whether it compiles. Anything else makes it another run.
SCHEDULE = ("steps", "eval_every", "eval_batches", "checkpoint_every", "compile")


def _run_differences(saved: ModelConfig, given: ModelConfig) -> list[str]:
    """The keys (dotted, within a section) in which `given` describes another run than `saved`."""
    a, b = saved.to_dict(), given.to_dict()
    changed = []
    for key in sorted(set(a) | set(b)):
        if key == "name" or a.get(key) == b.get(key):
            continue
        if key == "train":
            changed += [
                f"train.{k}" for k in sorted(a[key]) if k not in SCHEDULE and a[key][k] != b[key].get(k)
            ]
        else:
            changed.append(key)
    return changed


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel run (torch.distributed initialised, every rank
    with a Trainer of the same config). `balance`: split each global batch by attention work
    (model.balance), else in consecutive blocks. `row_wise`: tables to shard row-wise whatever
    their size (model.sharding.ShardingPlan.of)."""

    rank: int
    world: int
    balance: bool = True
    row_wise: tuple[str, ...] = ()

    @classmethod
    def of_group(cls, *, balance: bool = True, row_wise: tuple[str, ...] = ()) -> DataParallel:
        if not dist.is_initialized():
            raise RuntimeError("data-parallel training needs torch.distributed initialised (torchrun)")
        return cls(dist.get_rank(), dist.get_world_size(), balance, row_wise)

    def checkpoint(self, path: Path, rank: int | str | None = None) -> Path:
        """Rank `rank`'s checkpoint file (default: this rank's) for the run's `path`."""
        rank = self.rank if rank is None else rank
        return path.with_name(f"{path.stem}.rank{rank}-of-{self.world}{path.suffix}")


class Trainer:
    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        *,
        parallel: DataParallel | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.parallel = parallel if parallel is not None and parallel.world > 1 else None
        t = config.train
        torch.manual_seed(t.seed)
        sharding = None
        if self.parallel is not None:
            if t.embedding_update != "fused":  # before the group is made: no rank waits for this one
                raise ValueError(f"data-parallel training shards the tables; {FUSED_ONLY_CONFIG}")
            plan = ShardingPlan.of(config.tables, self.parallel.world, row_wise=self.parallel.row_wise)
            # The tables' exchanges go apart from DistributedDataParallel's reductions.
            sharding = Sharding(plan, dist.new_group())
        self.model = GEMModel(config, device=self.device, sharding=sharding)
        if sharding is not None and self.model.experts is not None:
            # The experts' balancing loss over the whole batch, every rank's part of it.
            self.model.experts.group = sharding.group
        self.dense_optimizer = torch.optim.AdamW(
            self.model.dense_parameters(), lr=t.lr, weight_decay=t.weight_decay
        )
        # Fused, the tables' backward steps them (model.embeddings): no optimizer of their own.
        embeddings = self.model.sparse.embeddings
        self.sparse_optimizer = (
            None
            if embeddings.fused
            else RowWiseAdagrad(
                [{"params": self.model.embedding_parameters(), "tables": embeddings.table_layout()}],
                lr=t.embedding_lr,
            )
        )
        self.traffic = TrafficGenerator(config, seed=t.seed)
        self.step = 0
        self.history = History()
        self.autocast_dtype = torch.bfloat16 if t.autocast and self.device.type == "cuda" else None
        self.peak = peak_flops(self.device, self.autocast_dtype or torch.float32)
        self._forward: Callable[[RequestBatch], Any] = self.model
        if self.parallel is not None:
            # The tables' buffers (each rank's shards and their optimizer state, its own) are left
            # out of DDP's broadcast from rank 0 at the start and before each forward.
            shards = self.model.sparse.embeddings.named_buffers(prefix="sparse.embeddings")
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self.model, [name for name, _ in shards]
            )
            self._forward = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        if t.compile:
            self._forward = torch.compile(self._forward)
        self._held_out: list[RequestBatch] | None = None

    # --- one step ---------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_step(self, batch: RequestBatch, weight: float = 1.0) -> torch.Tensor:
        """One step on `batch`; returns the loss (a device tensor: reading it syncs). `weight`
        scales the loss that the gradients come from (a rank's share of a global batch)."""
        self.model.train()
        self.dense_optimizer.zero_grad(set_to_none=True)
        if self.sparse_optimizer is not None:
            self.sparse_optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            output = self._forward(batch)
            loss, _ = self.model.loss(batch, output)
        (loss * weight if weight != 1.0 else loss).backward()
        self.dense_optimizer.step()
        if self.sparse_optimizer is not None:
            self.sparse_optimizer.step()
        self.step += 1
        return loss.detach()

    def step_flops(self, sizes: BatchSizes) -> dict[str, float]:
        return training_flops(forward_flops(self.config, sizes))

    # --- evaluation -------------------------------------------------------------------------

    def held_out(self) -> list[RequestBatch]:
        """The held-out batches (this rank's part of each, data-parallel)."""
        if self._held_out is None:
            batches = [self.traffic.batch(HELD_OUT_START + i) for i in range(self.config.train.eval_batches)]
            if self.parallel is not None:
                p = self.parallel
                batches = [rank_batch(b, p.rank, p.world, balance=False) for b in batches]
            self._held_out = [b.to(self.device) for b in batches]
        return self._held_out

    @torch.no_grad()
    def evaluate(self) -> EvalLog:
        """AUC and log loss per task on the held-out batches."""
        self.model.eval()
        logits, labels = [], []
        for batch in self.held_out():
            with self._autocast():
                logits.append(self.model(batch).logits.float())
            labels.append(batch.labels)
        logits_BT, labels_BT = torch.cat(logits), torch.cat(labels)
        if self.parallel is not None:  # every rank's part of the held-out batches
            parts: list[Any] = [None] * self.parallel.world
            dist.all_gather_object(parts, (logits_BT.cpu(), labels_BT.cpu()))
            logits_BT, labels_BT = (torch.cat(column) for column in zip(*parts, strict=True))
        tasks = self.config.tasks
        log = EvalLog(
            step=self.step,
            auc={t: auc(logits_BT[:, i], labels_BT[:, i]) for i, t in enumerate(tasks)},
            log_loss={t: log_loss(logits_BT[:, i], labels_BT[:, i]) for i, t in enumerate(tasks)},
        )
        self.history.evals.append(log)
        return log

    # --- the loop ---------------------------------------------------------------------------

    def fit(
        self,
        steps: int | None = None,
        *,
        checkpoint: Path | None = None,
        on_step: Callable[[StepLog], None] | None = None,
        on_eval: Callable[[EvalLog], None] | None = None,
        log_every: int = 10,
    ) -> History:
        """Train until step `steps` (the config's by default), evaluating every eval_every steps
        and at the end, saving to `checkpoint` every checkpoint_every steps and at the end."""
        t = self.config.train
        end = steps if steps is not None else t.steps
        if end <= self.step:
            return self.history
        history = self.config.history
        targets = history is not None and history.candidates_as_targets
        p = self.parallel
        loader = Batches(
            self.traffic,
            self.device,
            start=self.step,
            count=end - self.step,
            measure=lambda b: BatchSizes.of(b, candidates_as_targets=targets),
            part=None if p is None else lambda b: rank_batch(b, p.rank, p.world, balance=p.balance),
        )
        world = 1 if p is None else p.world
        if self.step == 0 and not self.history.evals:  # where the loss and AUC start from
            evaluation = self.evaluate()
            if on_eval is not None:
                on_eval(evaluation)
        window_start, window_examples, window_flops = time.perf_counter(), 0, 0.0
        try:
            for _, batch, sizes in loader:
                # The whole batch's sizes; this rank's share of its candidates weights its loss
                # (the ranks' gradients are averaged).
                share = batch.num_candidates / sizes.candidates
                loss = self.train_step(batch, weight=share * world)
                window_examples += sizes.candidates
                window_flops += sum(self.step_flops(sizes).values())
                if self.step % log_every == 0 or self.step == end:
                    value = self._global_loss(loss, share)  # syncs: the window's time is the device's
                    elapsed = time.perf_counter() - window_start
                    rate = window_flops / elapsed
                    log = StepLog(
                        step=self.step,
                        loss=value,
                        examples_per_s=window_examples / elapsed,
                        model_tflops_per_s=rate / 1e12,
                        mfu=None if self.peak is None else rate / (self.peak * world),
                    )
                    if not math.isfinite(value):
                        raise FloatingPointError(f"step {self.step}: the loss is {value}")
                    self.history.steps.append(log)
                    if on_step is not None:
                        on_step(log)
                    window_start, window_examples, window_flops = time.perf_counter(), 0, 0.0
                # Evaluating and saving are not training: the window's clock skips them.
                paused = time.perf_counter()
                if self.step % t.eval_every == 0 or self.step == end:
                    evaluation = self.evaluate()
                    if on_eval is not None:
                        on_eval(evaluation)
                if checkpoint is not None and (self.step % t.checkpoint_every == 0 or self.step == end):
                    self.save(checkpoint)
                window_start += time.perf_counter() - paused
        finally:
            loader.close()
        return self.history

    def _global_loss(self, loss: torch.Tensor, share: float) -> float:
        """The whole batch's loss: each rank's, weighted by its share of the candidates."""
        if self.parallel is None:
            return float(loss)
        total = (loss.float() * share).reshape(1)
        dist.all_reduce(total)
        return float(total)

    # --- checkpoints ------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Everything a resumed run needs, written atomically (data-parallel: each rank its own
        file beside `path`, DataParallel.checkpoint, renamed into place once every rank has
        written its own)."""
        path = Path(path) if self.parallel is None else self.parallel.checkpoint(Path(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        embeddings = self.model.sparse.embeddings
        state = {
            "config": self.config.to_dict(),
            "world": 1 if self.parallel is None else self.parallel.world,
            # The placement of the shards this file holds (data-parallel).
            "plan": embeddings.plan_state() if isinstance(embeddings, ShardedEmbeddings) else None,
            "step": self.step,
            "model": self.model.state_dict(),
            "dense_optimizer": self.dense_optimizer.state_dict(),
            # Fused, the tables' optimizer state is the model's (a buffer beside them).
            "sparse_optimizer": None if self.sparse_optimizer is None else self.sparse_optimizer.state_dict(),
            "history": {
                "steps": [asdict(s) for s in self.history.steps],
                "evals": [asdict(e) for e in self.history.evals],
            },
        }
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        if self.parallel is not None:
            dist.barrier()
        tmp.replace(path)

    @staticmethod
    def checkpoint_exists(path: Path, parallel: DataParallel | None = None) -> bool:
        """Whether the run's checkpoint `path` exists (data-parallel: every rank's file; every
        rank must ask at once). A ValueError where some ranks' files are missing, or only a run
        of another number of ranks saved there."""
        path = Path(path)
        world = 1 if parallel is None else parallel.world
        if parallel is None or world == 1:
            found = [path.exists()]
        else:
            found = [False] * world
            dist.all_gather_object(found, parallel.checkpoint(path).exists())
        if all(found):
            return True
        if any(found):
            missing = [r for r, f in enumerate(found) if not f]
            raise ValueError(
                f"{path}: the checkpoint files of rank(s) {missing} of {world} are missing: "
                "the run cannot resume where the other ranks stopped"
            )
        others = sorted(path.parent.glob(f"{path.stem}.rank0-of-*{path.suffix}")) + [path] * path.exists()
        if others:
            raise ValueError(
                f"{others[0]} was saved by a run of another number of ranks than this one's {world}: "
                "resume with as many, or train with another checkpoint"
            )
        return False

    @classmethod
    def resume(
        cls,
        path: Path,
        device: torch.device | str = "cpu",
        config: ModelConfig | None = None,
        *,
        parallel: DataParallel | None = None,
    ) -> Trainer:
        """The trainer saved at `path`. A `config` given must describe the same run (the same
        model, data and optimizer; how long it trains, how often it evaluates and saves, and
        whether it compiles may differ, and are then the given config's). Data-parallel, each
        rank reads its own file, saved by a run of as many ranks."""
        path = Path(path)
        world = 1 if parallel is None else parallel.world
        if world > 1:
            assert parallel is not None
            path = parallel.checkpoint(path)
        if not path.exists():
            raise ValueError(f"no checkpoint at {path}")
        state = torch.load(path, map_location=device, weights_only=False)
        if state.get("world", 1) != world:
            raise ValueError(
                f"{path} was saved by a run of {state.get('world', 1)} ranks; this one has {world}"
            )
        saved = config_from_dict(state["config"], where=f"{path} (its config)")
        if config is not None:
            changed = _run_differences(saved, config)
            if changed:
                raise ValueError(
                    f"{path} was trained with another config (differs in {changed}): resume it with its own "
                    "config, or train this one from the start with another checkpoint"
                )
            saved = config
        trainer = cls(saved, device, parallel=parallel)
        if parallel is not None and world > 1:
            # Every rank's file must be of the same step and placement, or the ranks would part.
            plan = trainer.model.sparse.embeddings.plan_state()
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, (state["step"], state.get("plan") == plan))
            steps = sorted({step for step, _ in everyone})
            if len(steps) > 1 or not all(same for _, same in everyone):
                raise ValueError(
                    f"{path} and the other ranks' files do not make one checkpoint (steps {steps}; "
                    f"placements of the tables as this run's: {[same for _, same in everyone]})"
                )
        trainer.model.load_state_dict(state["model"])
        trainer.dense_optimizer.load_state_dict(state["dense_optimizer"])
        if trainer.sparse_optimizer is not None:
            trainer.sparse_optimizer.load_state_dict(state["sparse_optimizer"])
        trainer.step = state["step"]
        trainer.history = History(
            steps=[StepLog(**s) for s in state["history"]["steps"]],
            evals=[EvalLog(**e) for e in state["history"]["evals"]],
        )
        return trainer

    def flops_summary(self, sizes: BatchSizes) -> dict[str, float]:
        """A training step's FLOPs by component (for the command line's table)."""
        return by_component(self.step_flops(sizes))
