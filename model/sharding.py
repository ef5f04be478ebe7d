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
Unpooled lookups (`lookup`, `gather`: candidate tokens, history events) send each distinct id
of the call once, and get its row back from the rank holding it alone. A call that any rank
must refuse (ids outside their tables, bad offsets, weights on some ranks only) is refused by
every rank together, in the first exchange.
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

    def rows(self, tables: Sequence[TableConfig], t: int, rank: int) -> int:
        """How many rows of table `t` rank `rank` holds."""
        shard = self.shard(tables, t, rank)
        if shard is None:
            return 0
        whole = tables[t].num_rows
        return whole if self.kinds[t] == TABLE_WISE else min(self.block(tables[t]), whole - shard.first_row)

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


class _SumOverRanks(torch.autograd.Function):
    """The sum of `x` over the group's ranks, differentiable: each rank's gradient is the sum of
    every rank's gradient of the sum (each rank's loss reads it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_ranks(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`x` summed over `group`'s ranks, with the gradient to every rank's `x`."""
    return _SumOverRanks.apply(x, group)


def _all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """A plain all-to-all along dim 0 (no gradient): `send[r]` rows to rank r."""
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
    return out


FUSED_ONLY = "sharded tables are trained by the fused update only"
# How a config file asks for it; the command line says it with --embedding-update.
FUSED_ONLY_CONFIG = f"{FUSED_ONLY}: set train.embedding_update = 'fused'"


@dataclass(frozen=True)
class _Sent:
    """Ids sent to the ranks holding their rows (_send): `order` sorts this rank's ids by
    destination, `send[r]` of them to rank r; from rank r came `receive[r]` (their `rows` in this
    rank's shards, their `bags` at the sender, and `weights`), and `batches[r]` is its B."""

    order: torch.Tensor
    send: list[int]
    receive: list[int]
    batches: list[int]
    rows: torch.Tensor
    bags: torch.Tensor
    weights: torch.Tensor | None


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
        self.configs, self.plan, self.dtype = list(tables), plan, dtype
        self.index = {t.name: i for i, t in enumerate(self.configs)}
        self.scale = 1.0 / (gradient_divisor if gradient_divisor is not None else self.world)
        device = torch.device(device) if device is not None else torch.device("cpu")
        num_tables = len(self.configs)
        # holds[r][t]: how many rows of table t rank r holds.
        self._holds = [[plan.rows(self.configs, t, r) for t in range(num_tables)] for r in range(self.world)]
        self.local_tables = [t for t in range(num_tables) if self._holds[self.rank][t]]
        shards = [plan.shard(self.configs, t, self.rank) for t in self.local_tables]
        local_configs = [
            TableConfig(
                name=self.configs[t].name, num_rows=self._holds[self.rank][t], dim=self.configs[t].dim
            )
            for t in self.local_tables
        ]
        self.local = (
            TableBatchedEmbeddings(
                local_configs, fused=True, lr=lr, eps=eps, dtype=dtype, device=device, shards=shards
            )
            if local_configs
            else None
        )
        if self.local is None:
            # The draw the local module makes: the global generator stays in step across ranks,
            # so the dense parameters made after start alike.
            torch.randint(0, 2**62, (1,))
        self.anchor = torch.zeros((), requires_grad=True)
        # Per global table (buffers, so that they follow the module's device; not saved): row-wise
        # or not, its owner (table-wise), its block of rows a rank (row-wise), its rows.
        meta = {
            "_row_wise": [k == ROW_WISE for k in plan.kinds],
            "_owner": [max(o, 0) for o in plan.owners],
            "_block_of": [
                plan.block(t) if k == ROW_WISE else t.num_rows
                for t, k in zip(self.configs, plan.kinds, strict=True)
            ],
            "_rows_of": [t.num_rows for t in self.configs],
        }
        for name, values in meta.items():
            self.register_buffer(name, torch.tensor(values, device=device), persistent=False)
        self._columns: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

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

    def plan_state(self) -> dict:
        """What a checkpoint of this rank's shards was made under (compared on resume)."""
        return {
            "world": self.world,
            "rank": self.rank,
            "kinds": list(self.plan.kinds),
            "owners": list(self.plan.owners),
        }

    @property
    def steps(self) -> int:
        return self.local.steps if self.local is not None else 0

    # --- the exchanges ------------------------------------------------------------------------

    def _send(
        self,
        tables: Sequence[str],
        table: torch.Tensor,
        ids: torch.Tensor,
        bag: torch.Tensor,
        batch: int,
        weights: torch.Tensor | None,
        problem: str | None,
    ) -> _Sent:
        """Every id (of table `table[i]`, in bag `bag[i]`) to the rank holding its row. The split
        sizes go first, with each rank's B, whether it is weighted, and how many of its ids lie
        outside their tables; `problem` is this rank's reason to refuse the call (None: none).
        Every rank then refuses a call that any rank refuses, together: none is left waiting in
        the next exchange."""
        row_wise, block = self._row_wise[table], self._block_of[table]
        owner = torch.where(row_wise, ids // block, self._owner[table])
        outside = ((ids < 0) | (ids >= self._rows_of[table])).sum()
        counts = torch.bincount(owner.clamp(0, self.world - 1), minlength=self.world)
        flags = torch.stack(
            [torch.full_like(counts, batch), counts.new_full((self.world,), weights is not None)], 1
        )
        sizes = torch.cat([counts[:, None], flags, outside.expand(self.world)[:, None]], 1)
        sizes[:, 3] += (problem is not None) << 40  # refused outright: beside any count of ids outside
        received = _all_to_all(sizes, [1] * self.world, [1] * self.world, self.group).tolist()
        refused = [r for r, (*_, bad) in enumerate(received) if bad >> 40]
        if refused:
            mine = f": {problem}" if problem is not None else ""
            raise ValueError(f"a lookup of {sorted(set(tables))} refused by rank(s) {refused}{mine}")
        if any(bad for *_, bad in received):
            ours = int(outside)
            raise ValueError(
                f"ids outside their tables in a lookup of {sorted(set(tables))}: {ours} of this rank's, "
                f"{sum(bad for *_, bad in received) - ours} of the other ranks'"
            )
        if len({weighted for _, _, weighted, _ in received}) > 1:
            raise ValueError(f"a lookup of {sorted(set(tables))} with per_sample_weights on some ranks only")
        order = torch.argsort(owner, stable=True)
        send, receive = counts.tolist(), [c for c, *_ in received]
        rows = torch.where(row_wise, ids - owner * block, ids)
        payload = _all_to_all(torch.stack([rows[order], bag[order]], dim=1), send, receive, self.group)
        sent_weights = None
        if weights is not None:
            sent_weights = _all_to_all(weights.detach()[order], send, receive, self.group)
        batches = [b for _, b, *_ in received]
        rows, bags = payload.unbind(1)
        return _Sent(order, send, receive, batches, rows.contiguous(), bags.contiguous(), sent_weights)

    def _back(self, values: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """Rows computed here for other ranks' ids back to them (the reverse of their sending),
        differentiably: the gradient goes to this rank's lookups."""
        return _Exchange.apply(values.reshape(-1), self.anchor, send, receive, self.group, self.scale)

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
        features = tuple(self.index[t] for t in tables)
        device = indices.device
        problem = _refusal(len(features), offsets, pooling, per_sample_weights)
        batch = 0 if problem is not None else (offsets.numel() - 1) // len(features)
        offsets = offsets.long() if problem is None else offsets.new_zeros(1, dtype=torch.int64)
        ids = indices.long() if problem is None else indices.new_zeros(0, dtype=torch.int64)
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=device), lengths, output_size=ids.numel()
        )
        table = torch.tensor(features, device=device)[bag // max(batch, 1)]
        sent = self._send(tables, table, ids, bag, batch, per_sample_weights, problem)

        # Pool what came here: every rank's bags of the features whose tables this rank holds,
        # feature-major over all ranks' bags (rank r's at rows start[r]...).
        held = [f for f, t in enumerate(features) if self._holds[self.rank][t]]
        total = sum(sent.batches)
        if held:
            assert self.local is not None
            position = torch.full((len(features),), -1, dtype=torch.int64)
            position[held] = torch.arange(len(held))
            source = torch.repeat_interleave(
                torch.arange(self.world, device=device),
                torch.tensor(sent.receive, device=device),
                output_size=sent.rows.numel(),
            )
            their_batch = torch.tensor(sent.batches, device=device)[source].clamp(min=1)
            start = torch.tensor([sum(sent.batches[:r]) for r in range(self.world)], device=device)
            key = (
                position.to(device)[sent.bags // their_batch] * total
                + start[source]
                + sent.bags % their_batch
            )
            by_bag = torch.argsort(key, stable=True)
            local_offsets = torch.zeros(len(held) * total + 1, dtype=torch.int64, device=device)
            torch.cumsum(torch.bincount(key, minlength=len(held) * total), 0, out=local_offsets[1:])
            pooled = self.local(
                [tables[f] for f in held],
                sent.rows[by_bag],
                local_offsets,
                per_sample_weights=None if sent.weights is None else sent.weights[by_bag],
            )
        else:
            pooled = torch.zeros(total, 0, device=device, dtype=self.dtype)

        # The pooled rows back to their bags' ranks; each feature's partial sums added.
        widths, columns = self._gathered(features, device)
        back = self._back(pooled, [b * widths[self.rank] for b in sent.batches], [batch * w for w in widths])
        blocks = [
            b.view(batch, w) for b, w in zip(back.split([batch * w for w in widths]), widths, strict=True)
        ]
        dims = [self.configs[t].dim for t in features]
        out = back.new_zeros(batch, sum(dims)).index_add(1, columns, torch.cat(blocks, dim=1))
        if pooling == "mean":
            per_column = (
                lengths.view(len(features), batch)
                .t()
                .repeat_interleave(torch.tensor(dims, device=device), dim=1)
            )
            out = out / per_column.clamp(min=1).to(out.dtype)
        return out

    def _gathered(self, features: tuple[int, ...], device: torch.device) -> tuple[list[int], torch.Tensor]:
        """For a call on `features`: the width of the pooled rows each rank sends back, and the
        output column of each value they hold, rank after rank (made once per feature list)."""
        if features not in self._columns:
            dims = [self.configs[t].dim for t in features]
            at = [sum(dims[:f]) for f in range(len(features))]
            widths, columns = [], []
            for holds in self._holds:
                held = [f for f, t in enumerate(features) if holds[t]]
                widths.append(sum(dims[f] for f in held))
                columns += [at[f] + c for f in held for c in range(dims[f])]
            self._columns[features] = (widths, torch.tensor(columns, dtype=torch.int64, device=device))
        return self._columns[features]

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """One row per id ([N, dim]): each distinct id sent once to the rank holding its row,
        and its row alone sent back."""
        t = self.index[table]
        dim = self.configs[t].dim
        distinct, inverse = torch.unique(ids.long(), return_inverse=True)
        positions = torch.arange(distinct.numel(), device=ids.device)
        sent = self._send(
            [table], torch.full_like(distinct, t), distinct, positions, distinct.numel(), None, None
        )
        if self._holds[self.rank][t] and sent.rows.numel():
            assert self.local is not None
            offsets = torch.arange(sent.rows.numel() + 1, device=ids.device)
            rows = self.local([table], sent.rows, offsets)  # in the order they came: rank by rank
        else:
            rows = torch.zeros(0, dim, device=ids.device, dtype=self.dtype)
        back = self._back(rows, [n * dim for n in sent.receive], [n * dim for n in sent.send])
        by_distinct = torch.empty_like(sent.order)
        by_distinct[sent.order] = torch.arange(sent.order.numel(), device=ids.device)
        return back.view(-1, dim)[by_distinct][inverse]

    def gather(self, table: str, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Each event's row ([T, dim]) of jagged sequences (offsets [B + 1]): a lookup of the
        events' ids (each distinct id exchanged once)."""
        return self.lookup(table, ids)


def _refusal(
    num_features: int, offsets: torch.Tensor, pooling: str, per_sample_weights: torch.Tensor | None
) -> str | None:
    """Why a pooled lookup cannot be made (None: it can), as TableBatchedEmbeddings would say."""
    if pooling not in ("sum", "mean"):
        return f"pooling must be 'sum' or 'mean', got {pooling!r}"
    if (offsets.numel() - 1) % num_features or offsets.numel() < 1:
        return f"offsets hold {offsets.numel() - 1} bags, not a multiple of {num_features} features"
    if per_sample_weights is not None and pooling != "sum":
        return "per_sample_weights is only supported with mode='sum'"
    if per_sample_weights is not None and per_sample_weights.requires_grad:
        return (
            "fused tables give per_sample_weights no gradient: detach them, or train with "
            "train.embedding_update = 'unfused'"
        )
    return None
