"""The model's embedding tables sharded over the ranks of a `torch.distributed` process group,
for data-parallel training whose tables outgrow one GPU.

Each table is placed whole on one rank (table-wise) or split into contiguous blocks of rows,
one per rank (row-wise), by `ShardingPlan.of`: table-wise while that keeps every rank's bytes
near the mean, the largest tables row-wise until it does. Each rank keeps its shards in a
`TableBatchedEmbeddings` of its own (one buffer, the fused optimizer) and answers for them.

A lookup (`ShardedEmbeddings.forward`, the same call as `TableBatchedEmbeddings.forward`) runs
on every rank at once, each with its own batch:
1. every id goes to the rank holding its row (all-to-all of the row numbers, their bags and
   weights; the split sizes first);
2. each rank pools what it received, every rank's bags in one `embedding_bags` launch over its
   shards (a row-wise table's bag gets a partial sum from each rank holding some of its ids);
3. the pooled rows go back (all-to-all), and each rank adds its features' partial sums into
   its [B, total dim] output (a mean divides by the whole bag's length there).
Backward runs the exchange of step 3 in reverse: each rank's gradient of the pooled rows goes
to the shards' ranks, where their lookups keep it, and the fused update steps each shard once at
the end of the backward pass, every rank's gradient of a row summed. The gradient reaching the
tables is divided by `gradient_divisor` (default: the world size), so that they step on the mean
over ranks of their losses, as DistributedDataParallel averages the dense gradients.

Every rank must make the same lookups in the same order, and use each one's output in its
loss (the exchanges are collectives, forward and backward): the model's code path is the same
on every rank, whatever its batch.
Unpooled lookups (`lookup`, `gather`: candidate tokens, history events) go as bags of one id,
each distinct id of the call once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from model.config import TableConfig
from model.embeddings import TableBatchedEmbeddings, TableShard

TABLE_WISE, ROW_WISE = "table", "row"
# Table-wise placement is kept while every rank holds at most this much over the mean bytes.
BALANCE_SLACK = 0.10


@dataclass(frozen=True)
class ShardingPlan:
    """Where each table lives: `kinds[t]` is TABLE_WISE (whole on rank `owners[t]`) or ROW_WISE
    (rows [r * block, (r + 1) * block) on rank r, block = ceil(rows / world))."""

    world: int
    kinds: tuple[str, ...]
    owners: tuple[int, ...]  # -1 for a row-wise table

    @classmethod
    def of(
        cls,
        tables: Sequence[TableConfig],
        world: int,
        *,
        element_bytes: int = 4,
        row_wise: Sequence[str] | None = None,
    ) -> ShardingPlan:
        """Table-wise, largest table first onto the rank holding the fewest bytes, while that
        keeps every rank within BALANCE_SLACK of the mean; else the largest table-wise table
        goes row-wise (every rank a block of its rows), and the placement is made again.
        `row_wise`: names of tables to shard row-wise whatever their size (the rest as above)."""
        if world < 1:
            raise ValueError(f"world must be at least 1, got {world}")
        names = [t.name for t in tables]
        unknown = sorted(set(row_wise or ()) - set(names))
        if unknown:
            raise ValueError(f"row_wise names tables that do not exist: {unknown} (tables: {names})")
        size = [t.num_rows * t.dim * element_bytes for t in tables]
        rows = {names.index(n) for n in row_wise or ()}
        while True:
            load = [sum(size[t] for t in rows) / world] * world
            owners = [-1] * len(tables)
            for t in sorted(set(range(len(tables))) - rows, key=lambda t: (-size[t], t)):
                r = min(range(world), key=lambda r: (load[r], r))
                owners[t] = r
                load[r] += size[t]
            whole = [t for t in range(len(tables)) if t not in rows]
            if not whole or max(load) <= (1 + BALANCE_SLACK) * sum(load) / world:
                break
            rows.add(max(whole, key=lambda t: (size[t], -t)))
        kinds = tuple(ROW_WISE if t in rows else TABLE_WISE for t in range(len(tables)))
        return cls(world, kinds, tuple(owners))

    def block(self, table: TableConfig) -> int:
        """Rows per rank of a row-wise table."""
        return -(-table.num_rows // self.world)

    def shard(self, tables: Sequence[TableConfig], t: int, rank: int) -> TableShard | None:
        """Rank `rank`'s rows of table `t` (None where it holds none)."""
        table = tables[t]
        if self.kinds[t] == TABLE_WISE:
            return TableShard(t, 0, table.num_rows) if self.owners[t] == rank else None
        first = rank * self.block(table)
        return TableShard(t, first, table.num_rows) if first < table.num_rows else None

    def describe(self, tables: Sequence[TableConfig]) -> list[str]:
        """A line per table: how it is sharded."""
        return [
            f"{t.name}: {t.num_rows:,} x {t.dim}, "
            + (f"table-wise on rank {o}" if k == TABLE_WISE else f"row-wise, {self.block(t):,} rows a rank")
            for t, k, o in zip(tables, self.kinds, self.owners, strict=True)
        ]


@dataclass(frozen=True)
class Sharding:
    """Tables sharded by `plan` over `group`'s ranks (None: the default group)."""

    plan: ShardingPlan
    group: dist.ProcessGroup | None = None


class _Exchange(torch.autograd.Function):
    """all_to_all_single of a flat tensor, differentiable: the gradient goes back the way the
    values came, times `scale`. `anchor` (a leaf that requires grad) puts the exchange in every
    rank's backward, even where this rank sent nothing that needs a gradient: the collective
    runs on every rank or none."""

    @staticmethod
    def forward(ctx, x, anchor, send, receive, group, scale):
        ctx.send, ctx.receive, ctx.group, ctx.scale = send, receive, group, scale
        out = x.new_empty(sum(receive))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back * ctx.scale, None, None, None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """A plain all-to-all along dim 0 (no gradient): `send[r]` rows to rank r."""
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
    return out


class ShardedEmbeddings(nn.Module):
    """The tables of `TableBatchedEmbeddings`, sharded by `plan` over `group`'s ranks, trained
    by the fused update on each shard. Its lookups are collectives (see the module's text)."""

    fused = True

    def __init__(
        self,
        tables: Sequence[TableConfig],
        plan: ShardingPlan,
        *,
        group: dist.ProcessGroup | None = None,
        lr: float = 0.05,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        gradient_divisor: float | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if plan.world != self.world:
            raise ValueError(f"the plan is for {plan.world} ranks, the group has {self.world}")
        self.configs, self.plan = list(tables), plan
        self.index = {t.name: i for i, t in enumerate(self.configs)}
        self.lr, self.eps = lr, eps
        self.scale = 1.0 / (gradient_divisor if gradient_divisor is not None else self.world)
        device = torch.device(device) if device is not None else torch.device("cpu")
        held = [(t, s) for t in range(len(self.configs)) if (s := plan.shard(self.configs, t, self.rank))]
        self.local_tables = [t for t, _ in held]  # global index of each local table
        local_configs = [
            TableConfig(
                name=self.configs[t].name,
                num_rows=min(s.table_rows - s.first_row, self._block(t)),
                dim=self.configs[t].dim,
            )
            for t, s in held
        ]
        # Every rank draws the local module's seed, holding shards or not: the global generator
        # stays in step across ranks, so the dense parameters made after start alike.
        self.local = TableBatchedEmbeddings(
            local_configs, fused=True, lr=lr, eps=eps, dtype=dtype, device=device, shards=[s for _, s in held]
        ) if held else None  # fmt: skip
        if self.local is None:
            torch.randint(0, 2**62, (1,))
        self.anchor = torch.zeros((), requires_grad=True)
        # Per global table: row-wise or not, its owner (table-wise), its block (row-wise).
        self._row_wise = torch.tensor([k == ROW_WISE for k in plan.kinds], device=device)
        self._owner = torch.tensor([max(o, 0) for o in plan.owners], device=device)
        self._block_of = torch.tensor([self._block(t) for t in range(len(self.configs))], device=device)
        self._rows_of = torch.tensor([t.num_rows for t in self.configs], device=device)
        # holds[r][t]: whether rank r holds rows of table t.
        self._holds = [
            [plan.shard(self.configs, t, r) is not None for t in range(len(self.configs))]
            for r in range(self.world)
        ]
        self._columns: dict[tuple[tuple[int, ...], str], tuple[list[int], torch.Tensor]] = {}

    def _block(self, t: int) -> int:
        return (
            self.plan.block(self.configs[t]) if self.plan.kinds[t] == ROW_WISE else self.configs[t].num_rows
        )

    def reset_parameters(self) -> None:
        if self.local is not None:
            self.local.reset_parameters()

    def table(self, name: str) -> torch.Tensor:
        raise NotImplementedError(
            f"table {name!r} is sharded over {self.world} ranks: read this rank's rows with local_table"
        )

    def local_table(self, name: str) -> tuple[torch.Tensor, int] | None:
        """This rank's rows of table `name` ([rows, dim], a view) and the first one's row number
        in the whole table; None where this rank holds none."""
        t = self.index[name]
        if self.local is None or t not in self.local_tables:
            return None
        shard = self.local.shards[self.local_tables.index(t)]
        return self.local.table(name), shard.first_row

    @property
    def steps(self) -> int:
        return self.local.steps if self.local is not None else 0

    # --- lookups ------------------------------------------------------------------------------

    def forward(
        self,
        tables: Sequence[str],
        indices: torch.Tensor,
        offsets: torch.Tensor,
        *,
        pooling: str = "sum",
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Features on `tables`, their bags feature-major (offsets [F * B + 1]) -> [B, sum of
        their dims]: what TableBatchedEmbeddings.forward returns for this rank's bags."""
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        features = [self.index[t] for t in tables]
        num_features = len(features)
        if (offsets.numel() - 1) % num_features:
            raise ValueError(
                f"offsets hold {offsets.numel() - 1} bags, not a multiple of {num_features} features"
            )
        batch = (offsets.numel() - 1) // num_features
        device, n = indices.device, indices.numel()
        dims = [self.configs[t].dim for t in features]
        offsets = offsets.long()
        lengths = offsets[1:] - offsets[:-1]

        # 1. Each id to the rank holding its row: its row there, its bag here, its weight.
        bag = torch.repeat_interleave(
            torch.arange(num_features * batch, device=device), lengths, output_size=n
        )
        table = torch.tensor(features, device=device)[bag // max(batch, 1)] if n else bag
        ids = indices.long()
        row_wise, block = self._row_wise[table], self._block_of[table]
        owner = torch.where(row_wise, ids // block, self._owner[table])
        rows = torch.where(row_wise, ids - owner * block, ids)
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner.clamp(0, self.world - 1), minlength=self.world)
        # Every rank tells every other how many ids it sends it, its B, and how many of its ids
        # lie outside their tables: then all ranks refuse such a call together.
        outside = ((ids < 0) | (ids >= self._rows_of[table])).sum()
        sizes = torch.stack([counts, torch.full_like(counts, batch), outside.expand(self.world)], dim=1)
        received = _all_to_all(sizes, [1] * self.world, [1] * self.world, self.group).tolist()
        if any(bad for _, _, bad in received):
            mine = int(outside)
            raise ValueError(
                f"ids outside their tables in a lookup of {sorted(set(tables))}: {mine} of this rank's, "
                f"{sum(bad for _, _, bad in received) - mine} of the other ranks'"
            )
        send, receive = counts.tolist(), [c for c, _, _ in received]
        batches = [b for _, b, _ in received]  # every rank's B
        payload = _all_to_all(torch.stack([rows[order], bag[order]], dim=1), send, receive, self.group)
        weights = None
        if per_sample_weights is not None:
            weights = _all_to_all(per_sample_weights.detach()[order], send, receive, self.group)

        # 2. Pool what came here: every rank's bags of the features whose tables this rank
        # holds, feature-major over all ranks' bags (rank r's at rows start[r]...).
        mine = [f for f, t in enumerate(features) if self._holds[self.rank][t]]
        total_bags = sum(batches)
        start = [sum(batches[:r]) for r in range(self.world)]
        if mine:
            assert self.local is not None
            position = torch.full((num_features,), -1, dtype=torch.int64)
            position[mine] = torch.arange(len(mine))
            source = torch.repeat_interleave(
                torch.arange(self.world, device=device),
                torch.tensor(receive, device=device),
                output_size=sum(receive),
            )
            source_batch = torch.tensor(batches, device=device)[source].clamp(min=1)
            their_bag = payload[:, 1]
            key = (
                position.to(device)[their_bag // source_batch] * total_bags
                + torch.tensor(start, device=device)[source]
                + their_bag % source_batch
            )
            by_bag = torch.argsort(key, stable=True)
            local_offsets = torch.zeros(len(mine) * total_bags + 1, dtype=torch.int64, device=device)
            torch.cumsum(torch.bincount(key, minlength=len(mine) * total_bags), 0, out=local_offsets[1:])
            pooled = self.local(
                [self.configs[features[f]].name for f in mine],
                payload[:, 0][by_bag],
                local_offsets,
                per_sample_weights=None if weights is None else weights[by_bag],
            )
        else:
            pooled = torch.zeros(total_bags, 0, device=device, dtype=self._dtype())

        # 3. The pooled rows back to their bags' ranks; each feature's partial sums added.
        widths, columns = self._gathered(tuple(features), device)
        width = widths[self.rank]
        back = _Exchange.apply(
            pooled.reshape(-1),
            self.anchor,
            [b * width for b in batches],
            [batch * w for w in widths],
            self.group,
            self.scale,
        )
        blocks = [
            b.view(batch, w) for b, w in zip(back.split([batch * w for w in widths]), widths, strict=True)
        ]
        out = back.new_zeros(batch, sum(dims)).index_add(1, columns, torch.cat(blocks, dim=1))
        if pooling == "mean":
            per_column = (
                lengths.view(num_features, batch)
                .t()
                .repeat_interleave(torch.tensor(dims, device=device), dim=1)
            )
            out = out / per_column.clamp(min=1).to(out.dtype)
        return out

    def _gathered(self, features: tuple[int, ...], device: torch.device) -> tuple[list[int], torch.Tensor]:
        """For a call on `features`: the width of the pooled rows each rank sends back, and the
        output column of each value they hold, rank after rank (made once per feature list)."""
        key = (features, str(device))
        if key not in self._columns:
            dims = [self.configs[t].dim for t in features]
            at = [sum(dims[:f]) for f in range(len(features))]
            widths, columns = [], []
            for holds in self._holds:
                held = [f for f, t in enumerate(features) if holds[t]]
                widths.append(sum(dims[f] for f in held))
                columns += [at[f] + c for f in held for c in range(dims[f])]
            self._columns[key] = (widths, torch.tensor(columns, dtype=torch.int64, device=device))
        return self._columns[key]

    def _dtype(self) -> torch.dtype:
        return self.local.weights.dtype if self.local is not None else torch.float32

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """One row per id ([N, dim]): each distinct id once, as a bag of one."""
        distinct, inverse = torch.unique(ids, return_inverse=True)
        offsets = torch.arange(distinct.numel() + 1, device=ids.device)
        return self([table], distinct, offsets)[inverse]

    def gather(self, table: str, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Each event's row ([T, dim]) of jagged sequences (offsets [B + 1]): a lookup of the
        events' ids (each distinct id exchanged once)."""
        return self.lookup(table, ids)
