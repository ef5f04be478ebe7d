"""The model's embedding tables, batched: every table in one flat buffer (the layout of
search_space.packed_tables), looked up by keyed bags through `kernels.ops.embedding_bags`, one
launch for all the features of a call, and trained in one of two ways.

- fused (the default): no dense gradient exists. Each lookup's backward keeps its gradient
  (the pooled outputs', [B, total dim]: small) and, at the end of the backward pass, one
  `kernels.ops.embedding_bags_update` applies the optimizer step (row-wise Adagrad) to every row
  the step looked up, in place, each row once with its gradient summed over every call, bag and
  feature that holds it: a candidate's item looked up as a feature, as a token and in histories
  is one row, updated once. The tables and the optimizer's state are buffers of this module.
- unfused: the tables are one parameter, its dense gradient made by `embedding_bags`' backward,
  stepped by model.optim.RowWiseAdagrad; the same math, for comparison.

Lookups of different batch sizes (requests, candidates, history events) join in the one update
as bags of one sample each: the update's layout takes a feature per bag, with the bag's own
table and its own columns of the joined gradient.

Fused, every backward pass that reaches a lookup steps the tables once when it ends: gradient
accumulation over micro-batches steps them once per micro-batch, and a second backward through
the same graph steps them again. Under torch.compile each fused lookup is a graph break (the
engine's end-of-pass callback is not traced).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kernels import ops
from kernels.packed_tables import Layout
from model.config import TableConfig

# Rows drawn from one seed at a time in reset_parameters.
INIT_BLOCK_ROWS = 1 << 16


@dataclass(frozen=True)
class TableShard:
    """Rows [first_row, first_row + rows of the table's config) of table `key` (its index in the
    model's tables: its rows' seed), which has `table_rows` rows."""

    key: int
    first_row: int
    table_rows: int


def init_rows(table: torch.Tensor, shard: TableShard, *, seed: int) -> None:
    """Fill `table` ([rows, dim], rows `shard.first_row` onwards of a whole table of
    `shard.table_rows`) with U(-1/sqrt(table_rows), 1/sqrt(table_rows)): each block of
    INIT_BLOCK_ROWS rows of the whole table from its own seed, so any shard of the table, on
    any rank, draws the rows the whole table holds (on one device type)."""
    bound = 1.0 / shard.table_rows**0.5
    rows, dim = table.shape
    end = shard.first_row + rows
    generator = torch.Generator(device=table.device)
    for block in range(shard.first_row // INIT_BLOCK_ROWS, -(-end // INIT_BLOCK_ROWS)):
        lo = block * INIT_BLOCK_ROWS
        hi = min(lo + INIT_BLOCK_ROWS, shard.table_rows)
        generator.manual_seed(seed + block)
        drawn = torch.empty(hi - lo, dim, device=table.device).uniform_(-bound, bound, generator=generator)
        a, b = max(lo, shard.first_row), min(hi, end)
        table[a - shard.first_row : b - shard.first_row] = drawn[a - lo : b - lo]


@dataclass(frozen=True)
class _Call:
    """What a lookup call's backward keeps for the step: its gradient and its bags."""

    grad_out: torch.Tensor | None  # [B, total dim], once the backward has it
    features: tuple[int, ...]  # the table of each of its features
    indices: torch.Tensor
    offsets: torch.Tensor
    mean: bool
    per_sample_weights: torch.Tensor | None


class TableBatchedEmbeddings(nn.Module):
    def __init__(
        self,
        tables: Sequence[TableConfig],
        *,
        fused: bool = True,
        lr: float = 0.05,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        shards: Sequence[TableShard] | None = None,
    ) -> None:
        """`shards`: where the tables are shards of larger ones (model.sharding), each one's
        first row and row count in its whole table: its rows start as the whole table's would."""
        super().__init__()
        self.configs = list(tables)
        self.shards = (
            list(shards)
            if shards is not None
            else [TableShard(i, 0, t.num_rows) for i, t in enumerate(self.configs)]
        )
        if len(self.shards) != len(self.configs):
            raise ValueError(f"{len(self.shards)} shards given for {len(self.configs)} tables")
        # Drawn once from the global generator (seeded alike on every rank): the rows' seed.
        self.init_seed = int(torch.randint(0, 2**62, (1,)))
        self.index = {t.name: i for i, t in enumerate(self.configs)}
        self.layout = Layout.of([(t.num_rows, t.dim) for t in self.configs], range(len(self.configs)))
        self.fused, self.lr, self.eps = fused, lr, eps
        self._weight_at = self.layout.table_weight_offsets()
        weights = torch.empty(self.layout.num_elements, dtype=dtype, device=device)
        if fused:
            self.register_buffer("weights", weights)
            self.register_buffer("state", torch.zeros(self.layout.num_rows, device=device))
            # A leaf that every fused lookup takes, so that autograd runs its backward: not a
            # parameter (no optimizer steps it, nothing saves it), it never gets a gradient.
            self.anchor = torch.zeros((), requires_grad=True)
        else:
            self.weights = nn.Parameter(weights)
        self._metadata: dict[tuple, tuple] = {}
        self._table_ids_on: dict[tuple, torch.Tensor] = {}
        self._pending: list[_Call] = []
        self._pass: int | None = None  # the backward pass the pending gradients belong to
        self.steps = 0  # fused updates applied: the stochastic rounding's seed, in the checkpoint
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # U(-1/sqrt(rows), 1/sqrt(rows)) of the whole table: pooled sums of hot rows start small
        # whatever the size. Drawn in blocks of rows, each from its own seed, so that a shard
        # holds the rows the whole table would.
        with torch.no_grad():
            for t, shard in zip(self.configs, self.shards, strict=True):
                init_rows(self.table(t.name), shard, seed=self.init_seed + shard.key * 1_000_003)
            if self.fused:
                self.state.zero_()

    def table(self, name: str) -> torch.Tensor:
        """Table `name`, a [rows, dim] view of the buffer."""
        return self.layout.table_view(self.weights, self.index[name])

    def table_layout(self) -> list[tuple[int, int, int]]:
        """(element offset, rows, dim) of each table in the buffer, for an unfused optimizer."""
        return [(at, t.num_rows, t.dim) for at, t in zip(self._weight_at, self.configs, strict=True)]

    def _features(self, tables: tuple[int, ...], device: torch.device) -> tuple:
        """(weight_offsets, row_offsets, dim_offsets, total dim, max dim) of features on
        `tables`, made once per feature list and device."""
        key = (tables, str(device))
        if key not in self._metadata:
            layout = Layout(self.layout.tables, tables)
            self._metadata[key] = (*layout.metadata(device), layout.total_dim, layout.max_dim)
        return self._metadata[key]

    def _table_ids(self, tables: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """`tables` as a tensor on `device`, made once: a tensor made from a list on a GPU
        waits for the GPU's queue, and the update asks for one per lookup every step."""
        key = (tables, str(device))
        if key not in self._table_ids_on:
            self._table_ids_on[key] = torch.tensor(tables, device=device)
        return self._table_ids_on[key]

    def forward(
        self,
        tables: Sequence[str],
        indices: torch.Tensor,
        offsets: torch.Tensor,
        *,
        pooling: str = "sum",
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Features on `tables` (one name per feature), their bags feature-major (offsets
        [F * B + 1]) -> [B, sum of their dims], each feature's pooled rows in order."""
        features = tuple(self.index[t] for t in tables)
        w, _, d, total, widest = self._features(features, indices.device)

        def lookup() -> torch.Tensor:
            return ops.embedding_bags(
                self.weights, w, d, indices, offsets,
                total_dim=total, max_dim=widest, mode=pooling, per_sample_weights=per_sample_weights,
            )  # fmt: skip

        if not self.fused:
            return lookup()
        if per_sample_weights is not None and per_sample_weights.requires_grad:
            raise ValueError(
                "fused tables give per_sample_weights no gradient: detach them, or train with "
                "train.embedding_update = 'unfused'"
            )
        kept = _Call(None, features, indices, offsets, pooling == "mean", per_sample_weights)
        return _FusedLookup.apply(self.anchor, self, lookup, kept)

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """One row per id ([N, dim]): bags of one, through the same op as the features."""
        offsets = torch.arange(ids.shape[0] + 1, device=ids.device, dtype=ids.dtype)
        return self([table], ids, offsets)

    def gather(self, table: str, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Each event's row ([T, dim]) of jagged sequences (offsets [B + 1]: user histories),
        through kernels.ops.history_gather: the ids' sort order groups an id's repeats, so its
        row is read once per tile. Trained as lookups are (fused, its gradient joins the step's
        update as bags of one id)."""
        order = torch.argsort(ids, stable=True)

        def lookup() -> torch.Tensor:
            return ops.history_gather(self.table(table), ids, offsets, order=order)

        if not self.fused:
            return lookup()
        bags = torch.arange(ids.shape[0] + 1, device=ids.device, dtype=ids.dtype)
        return _FusedLookup.apply(
            self.anchor, self, lookup, _Call(None, (self.index[table],), ids, bags, False, None)
        )

    # --- the fused update ---------------------------------------------------------------------

    def _keep(self, call: _Call) -> None:
        """A lookup's backward: keep its gradient; the first of a backward pass asks the engine
        to apply them all when the pass ends. Gradients kept by a pass that never ended (its
        backward raised) are dropped, not applied with the next pass's."""
        current = torch._C._current_graph_task_id()
        if current != self._pass:
            self._pending, self._pass = [], current
            torch.autograd.Variable._execution_engine.queue_callback(self.apply_pending)
        self._pending.append(call)

    def get_extra_state(self) -> dict:
        return {"steps": self.steps}

    def set_extra_state(self, state: dict) -> None:
        self.steps = int(state["steps"])

    @torch.no_grad()
    def apply_pending(self) -> None:
        """One fused update from every lookup's gradient kept since the last: each call's bags
        become features of one sample (B = 1), so calls of any batch size join in one launch."""
        calls, self._pending, self._pass = self._pending, [], None
        if not calls:
            return
        device = calls[0].grad_out.device
        # Per table (the tables as features, in order: made once per device).
        weight_at, row_at, dim_at, _, _ = self._features(tuple(range(len(self.configs))), device)
        dims = dim_at[1:] - dim_at[:-1]
        tables, grads, indices, offsets, weights = [], [], [], [], []
        shift = 0
        weighted = any(c.per_sample_weights is not None for c in calls)
        for c in calls:
            batch = c.grad_out.shape[0]
            tables.append(self._table_ids(c.features, device).repeat_interleave(batch))
            lengths = (c.offsets[1:] - c.offsets[:-1]).clamp(min=1).float()
            at = 0
            for f, table in enumerate(c.features):  # feature f's [B, dim] block, bag after bag
                dim = self.configs[table].dim
                block = c.grad_out[:, at : at + dim].float()
                if c.mean:  # the update sums: a mean's 1 / len(bag) goes into its gradient
                    block = block / lengths[f * batch : (f + 1) * batch, None]
                grads.append(block.reshape(-1))
                at += dim
            indices.append(c.indices.long())
            offsets.append(c.offsets[:-1].long() - c.offsets[0].long() + shift)
            shift += c.indices.shape[0]
            if weighted:
                psw = c.per_sample_weights
                weights.append(
                    psw.float() if psw is not None else torch.ones(c.indices.shape[0], device=device)
                )
        bag_tables = torch.cat(tables)
        bag_dims = dims[bag_tables]
        dim_offsets = torch.zeros(bag_tables.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(bag_dims, 0, out=dim_offsets[1:])
        flat_grad = torch.cat(grads).to(self.weights.dtype)
        ops.embedding_bags_update(
            self.weights,
            self.state,
            flat_grad.view(1, -1),
            weight_at[bag_tables],
            row_at[bag_tables],
            dim_offsets,
            torch.cat(indices),
            torch.cat([*offsets, torch.full((1,), shift, device=device)]),
            max_dim=self.layout.max_dim,
            optimizer="adagrad",
            lr=self.lr,
            eps=self.eps,
            per_sample_weights=torch.cat(weights).to(self.weights.dtype) if weighted else None,
            stochastic_rounding=self.weights.dtype != torch.float32,
            seed=self.steps,
        )
        self.steps += 1


class _FusedLookup(torch.autograd.Function):
    """A fused lookup: `lookup()`'s rows forward; backward keeps grad_out with the call's bags
    for the module's update (TableBatchedEmbeddings._keep) and gives no gradient to anything."""

    @staticmethod
    def forward(ctx, anchor, module, lookup, kept):
        ctx.module, ctx.kept = module, kept
        return lookup()

    @staticmethod
    def backward(ctx, grad_out):
        ctx.module._keep(dataclasses.replace(ctx.kept, grad_out=grad_out))
        return None, None, None, None
