"""Many embedding tables in one buffer, and the keyed bags that look them up: the layout the
table-batched embedding ops share (search_space.embedding_bags, its training update).

Tables. Every table's rows lie in one flat buffer `weights`, one table after another, each
row-major [num_rows_t, dim_t], all of one dtype. Row-wise optimizer state (one fp32 value per
row) lies in one flat buffer `state` of sum_t num_rows_t, in the same table order.

Features. F features look tables up (several may share one: unified embeddings). Per feature
f, three int64 tensors say where its table lies and where its output goes:
    weight_offsets[f]   the element offset in `weights` of row 0 of f's table;
    row_offsets[f]      the offset in `state` of the same row;
    dim_offsets[f]      f's first column of the output ([F + 1]: dim_offsets[F] is the total);
so f's dim is dim_offsets[f + 1] - dim_offsets[f], and row r of its table is
weights[weight_offsets[f] + r * dim_f : ... + dim_f].

Bags (the layout of a keyed jagged tensor). With B samples, `offsets` [F * B + 1] delimits the
ids of bag (f, b), feature-major: indices[offsets[f * B + b] : offsets[f * B + b + 1]] are rows
of f's table. The pooled output is [B, dim_offsets[F]]: sample b's row holds each feature's
pooled vector in feature order (a keyed tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from search_space import workload


@dataclass(frozen=True)
class Layout:
    """Where F features' tables lie (host side): each table's (num_rows, dim), and the table of
    each feature."""

    tables: tuple[tuple[int, int], ...]
    features: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.features:
            raise ValueError("a layout needs at least one feature")
        for rows, dim in self.tables:
            if rows < 1 or dim < 1:
                raise ValueError(f"a table needs rows and columns, got ({rows}, {dim})")
        bad = [t for t in self.features if not 0 <= t < len(self.tables)]
        if bad:
            raise ValueError(f"features name tables {bad}, outside the {len(self.tables)} tables")

    @classmethod
    def of(cls, tables: Sequence[Sequence[int]], features: Sequence[int]) -> Layout:
        return cls(tuple((int(r), int(d)) for r, d in tables), tuple(int(t) for t in features))

    @property
    def num_features(self) -> int:
        return len(self.features)

    def table_weight_offsets(self) -> list[int]:
        out, at = [], 0
        for rows, dim in self.tables:
            out.append(at)
            at += rows * dim
        return out

    def table_row_offsets(self) -> list[int]:
        out, at = [], 0
        for rows, _ in self.tables:
            out.append(at)
            at += rows
        return out

    @property
    def num_elements(self) -> int:
        return sum(rows * dim for rows, dim in self.tables)

    @property
    def num_rows(self) -> int:
        return sum(rows for rows, _ in self.tables)

    def dims(self) -> list[int]:
        """Each feature's dim."""
        return [self.tables[t][1] for t in self.features]

    def dim_offsets(self) -> list[int]:
        out = [0]
        for dim in self.dims():
            out.append(out[-1] + dim)
        return out

    @property
    def total_dim(self) -> int:
        return sum(self.dims())

    @property
    def max_dim(self) -> int:
        return max(self.dims())

    def metadata(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight_offsets [F], row_offsets [F], dim_offsets [F + 1]), int64 on `device`."""
        weights, rows = self.table_weight_offsets(), self.table_row_offsets()
        return (
            torch.tensor([weights[t] for t in self.features], dtype=torch.int64, device=device),
            torch.tensor([rows[t] for t in self.features], dtype=torch.int64, device=device),
            torch.tensor(self.dim_offsets(), dtype=torch.int64, device=device),
        )

    def table_view(self, weights: torch.Tensor, table: int) -> torch.Tensor:
        """Table `table` of a flat `weights` buffer, as a [num_rows, dim] view."""
        rows, dim = self.tables[table]
        start = self.table_weight_offsets()[table]
        return weights[start : start + rows * dim].view(rows, dim)


def metadata_lists(
    weight_offsets: torch.Tensor, row_offsets: torch.Tensor | None, dim_offsets: torch.Tensor
) -> tuple[list[int], list[int] | None, list[int]]:
    """The per-feature metadata on the host (a sync where it lies on a GPU): for references and
    argument checks."""
    return (
        weight_offsets.tolist(),
        None if row_offsets is None else row_offsets.tolist(),
        dim_offsets.tolist(),
    )


def table_rows(weight_offsets: Sequence[int], dims: Sequence[int], num_elements: int) -> dict[int, int]:
    """Each table's row count, by its weight offset, from per-feature offsets and dims: a table
    runs to the next table's offset (the last to the buffer's end)."""
    dim_of = dict(zip(weight_offsets, dims, strict=True))
    starts = sorted(dim_of)
    ends = [*starts[1:], num_elements]
    return {start: (end - start) // dim_of[start] for start, end in zip(starts, ends, strict=True)}


def feature_table(weights: torch.Tensor, weight_offset: int, dim: int) -> torch.Tensor:
    """Every row that fits in a flat `weights` from a table's start, as a [rows, dim] view: the
    per-feature metadata does not say how many rows a table has, and its ids stay inside it."""
    rows = (weights.shape[0] - weight_offset) // dim
    return weights[weight_offset : weight_offset + rows * dim].view(rows, dim)


def power_law_lengths(
    count: int, max_len: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """`count` bag lengths in [1, max_len], P(L) proportional to L^-BAG_LENGTH_ALPHA: with
    max_len 3, 57% of bags hold one id; with 120, the mean is about 19."""
    probs = torch.arange(1, max_len + 1, dtype=torch.float32, device=device).pow(-workload.BAG_LENGTH_ALPHA)
    return torch.multinomial(probs / probs.sum(), count, replacement=True, generator=generator) + 1


@dataclass(frozen=True)
class Bags:
    """Keyed bags: ids [nnz], offsets [F * B + 1] (feature-major), and per-sample weights."""

    indices: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: torch.Tensor | None


def draw_bags(
    layout: Layout,
    batch: int,
    generator: torch.Generator,
    device: torch.device,
    *,
    max_lens: Sequence[int] | None = None,
    lengths: Sequence[int] | None = None,
    hot_rows: int = 0,
    weighted: bool = False,
    index_dtype: torch.dtype = torch.int64,
    weight_dtype: torch.dtype = torch.float32,
) -> Bags:
    """Bags of `batch` samples for every feature of `layout`: explicit `lengths` (F * batch,
    feature-major), or power-law lengths up to each feature's `max_lens[f]` (0: empty bags).
    Ids are uniform over the feature's table, but with `hot_rows` > 0 every id is one of the
    table's last `hot_rows` rows (rows repeated across many bags, and ids at the last row)."""
    num = layout.num_features * batch
    if lengths is not None:
        if len(lengths) != num:
            raise ValueError(
                f"{len(lengths)} bag lengths for {layout.num_features} features x {batch} samples"
            )
        lens = torch.tensor(list(lengths), dtype=torch.int64, device=device)
    else:
        if max_lens is None or len(max_lens) != layout.num_features:
            raise ValueError(f"one max_len per feature ({layout.num_features}), got {max_lens}")
        parts = [
            power_law_lengths(batch, m, generator, device)
            if m > 0
            else torch.zeros(batch, dtype=torch.int64, device=device)
            for m in max_lens
        ]
        lens = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    offsets = torch.zeros(num + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens, 0, out=offsets[1:])
    feature_lens = lens.view(layout.num_features, batch).sum(1).tolist()
    chunks = []
    for table, count in zip(layout.features, feature_lens, strict=True):
        rows = layout.tables[table][0]
        low = max(rows - hot_rows, 0) if hot_rows else 0
        chunks.append(torch.randint(low, rows, (count,), generator=generator, device=device))
    indices = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int64, device=device)
    psw = None
    if weighted:
        psw = torch.rand(indices.numel(), generator=generator, device=device).to(weight_dtype)
    return Bags(indices.to(index_dtype), offsets.to(index_dtype), psw)


def mean_bag_length(max_len: int) -> float:
    """The mean of power_law_lengths(max_len) (0 for 0)."""
    if max_len <= 0:
        return 0.0
    support = range(1, max_len + 1)
    norm = sum(n**-workload.BAG_LENGTH_ALPHA for n in support)
    return sum(n ** (1 - workload.BAG_LENGTH_ALPHA) for n in support) / norm
