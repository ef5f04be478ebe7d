"""The GEM-class ads ranking model, request-oriented.

    user tower (once per request)        candidate side (per candidate)
    ─────────────────────────────        ──────────────────────────────
    user features → pooled, projected    item features → pooled, projected
    history (item, action, age) → HSTU   target attention (or GDPA) over the encoded history
                                         dense features → one embedding
                  └──────────── Wukong layers over the stacked embeddings ───┘
                  (the first layer reads the user's embeddings from the request)
                         (sparse mixture of experts) → CTR and CVR heads

Every op with a kernel of its own goes through `kernels.ops` (embedding bags, jagged and target
attention, GDPA, jagged concat and split, the Wukong block, the experts' grouped GEMM), so
kernels the library registers later speed the model up with no change here; the rest is plain
torch (linear layers, norms, small reductions). Nothing here imports triton.

`forward` computes everything that depends only on the user once per request and broadcasts it
to the request's candidates; `naive_forward` gives every candidate its own copy of its request
(what a ranking service without request-oriented inference computes), for comparison: both
score a batch alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.ops import (
    gdpa,
    grouped_gemm,
    jagged_concat,
    jagged_split,
    target_attention,
    wukong_fm,
)
from model.config import FeatureConfig, ModelConfig
from model.data import Bags, RequestBatch
from model.embeddings import TableBatchedEmbeddings
from model.hstu import HSTULayer
from model.sharding import FUSED_ONLY_CONFIG, ShardedEmbeddings, Sharding, sum_over_ranks


def mlp(in_dim: int, dims: Sequence[int], *, last_activation: bool = True, device=None) -> nn.Sequential:
    """Linear + ReLU for each size in `dims` (the last without ReLU unless last_activation)."""
    layers: list[nn.Module] = []
    for i, out_dim in enumerate(dims):
        layers.append(nn.Linear(in_dim, out_dim, device=device))
        if last_activation or i < len(dims) - 1:
            layers.append(nn.ReLU())
        in_dim = out_dim
    return nn.Sequential(*layers)


def _offsets_cat(
    parts: Sequence[Bags], hash_sizes: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Several features' bags as one keyed input (feature-major: all of the first's bags, then
    the second's), their ids hashed into each feature's rows: (ids, offsets, weights)."""
    ids, offsets, weights = [], [], []
    shift = 0
    for bags, hash_size in zip(parts, hash_sizes, strict=True):
        ids.append(bags.ids.remainder(hash_size))
        offsets.append(bags.offsets[:-1] + shift)
        shift += bags.ids.shape[0]
        if bags.weights is not None:
            weights.append(bags.weights)
    end = parts[-1].offsets[-1:] + (shift - parts[-1].ids.shape[0])
    return torch.cat(ids), torch.cat([*offsets, end]), torch.cat(weights) if weights else None


class SparseArch(nn.Module):
    """The embedding tables (model.embeddings: one buffer, trained by the update fused into the
    backward unless the config says unfused), and each side's features pooled and projected to
    the interaction dim: one `embedding_bags` launch per (pooling, weighting) group of a side,
    whatever tables its features read (features that share a table share its rows: unified
    embeddings)."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | None = None, sharding: Sharding | None = None
    ) -> None:
        super().__init__()
        self.config = config
        dim = config.interaction.dim
        t = config.train
        self.embeddings: TableBatchedEmbeddings | ShardedEmbeddings
        if sharding is None:
            self.embeddings = TableBatchedEmbeddings(
                config.tables, fused=t.embedding_update == "fused", lr=t.embedding_lr, device=device
            )
        else:
            if t.embedding_update != "fused":
                raise ValueError(FUSED_ONLY_CONFIG)
            self.embeddings = ShardedEmbeddings(
                config.tables, sharding.plan, group=sharding.group, lr=t.embedding_lr, device=device
            )
        self.projections = nn.ModuleDict(
            {
                f"from_{t.name}": nn.Linear(t.dim, dim, bias=False, device=device)
                for t in config.tables
                if t.dim != dim
            }
        )
        self.groups: dict[str, list[tuple[str, bool, list[FeatureConfig]]]] = {}
        for side in ("user", "item"):
            grouped: dict[tuple[str, bool], list[FeatureConfig]] = {}
            for f in config.features_of(side):
                grouped.setdefault((f.pooling, f.weighted), []).append(f)
            self.groups[side] = [(p, w, fs) for (p, w), fs in grouped.items()]

    def reset_parameters(self) -> None:
        self.embeddings.reset_parameters()

    def table(self, name: str) -> torch.Tensor:
        return self.embeddings.table(name)

    def project(self, table: str, x: torch.Tensor) -> torch.Tensor:
        key = f"from_{table}"
        return self.projections[key](x) if key in self.projections else x

    def forward(self, features: dict[str, Bags], side: str, num_bags: int) -> torch.Tensor | None:
        """features: name -> bags (num_bags each) of this side's features -> [num_bags, n, dim]
        (None for a side without features)."""
        if not self.groups[side]:
            return None
        pooled: dict[str, torch.Tensor] = {}
        for pooling, _, feats in self.groups[side]:
            missing = [f.name for f in feats if f.name not in features]
            if missing:
                raise ValueError(f"batch lacks {side} feature(s) {missing}")
            ids, offsets, weights = _offsets_cat(
                [features[f.name] for f in feats], [self.config.hash_size(f) for f in feats]
            )
            out = self.embeddings(
                [f.table for f in feats], ids, offsets, pooling=pooling, per_sample_weights=weights
            )
            at = 0
            for f in feats:
                width = self.config.table(f.table).dim
                pooled[f.name] = self.project(f.table, out[:, at : at + width])
                at += width
        return torch.stack([pooled[f.name] for f in self.config.features_of(side)], dim=1)

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """One row per id ([N, table dim]): bags of one, through the same op as the features."""
        return self.embeddings.lookup(table, ids)


class HistoryEncoder(nn.Module):
    """A request's history of (item, action, age) events, embedded (the item's row of the
    unified item table, projected, plus learned action and age embeddings) and encoded by HSTU
    layers; with candidates_as_targets, the request's candidates join it as targets."""

    def __init__(self, config: ModelConfig, *, device: torch.device | None = None) -> None:
        super().__init__()
        h = config.history
        assert h is not None
        self.config = h
        item_dim = config.table(h.item_table).dim
        self.item_proj = nn.Linear(item_dim, h.model_dim, device=device)
        self.actions = nn.Embedding(h.num_actions, h.model_dim, device=device)
        self.ages = nn.Embedding(h.time_buckets, h.model_dim, device=device)
        # Marks the candidates' tokens among the history's, where they join it as targets.
        self.target_marker = (
            nn.Parameter(torch.zeros(h.model_dim, device=device)) if h.candidates_as_targets else None
        )
        self.max_seq_len = h.max_len + (h.max_targets if h.candidates_as_targets else 0)
        self.layers = nn.ModuleList(
            HSTULayer(
                h.model_dim,
                h.num_heads,
                h.head_dim,
                num_buckets=h.num_buckets,
                max_seq_len=self.max_seq_len,
                activation=h.attention,
                device=device,
            )
            for _ in range(h.num_layers)
        )

    def forward(
        self, batch: RequestBatch, items_TE: torch.Tensor, candidates_BM: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """items_TE: the history's item rows; candidates_BM: the candidates' item tokens ->
        (encoded history [T, model_dim], encoded candidate tokens [B, model_dim] or None)."""
        x_TM = self.item_proj(items_TE) + self.actions(batch.history_actions) + self.ages(batch.history_ages)
        offsets, num_targets = batch.history_offsets, None
        if self.config.candidates_as_targets:
            if batch.max_candidates > self.config.max_targets:
                raise ValueError(
                    f"requests of up to {batch.max_candidates} candidates, but history.max_targets is "
                    f"{self.config.max_targets}: raise it to encode candidates as targets"
                )
            assert self.target_marker is not None
            targets_BM = (candidates_BM + self.target_marker).to(x_TM.dtype)
            x_TM = jagged_concat(x_TM, batch.history_offsets, targets_BM, batch.candidate_offsets)
            offsets = batch.history_offsets + batch.candidate_offsets
            num_targets = batch.candidate_offsets[1:] - batch.candidate_offsets[:-1]
        for layer in self.layers:
            x_TM = layer(x_TM, offsets, num_targets)
        if not self.config.candidates_as_targets:
            return x_TM, None
        history_TM, targets_BM = jagged_split(
            x_TM, offsets, batch.history_offsets, first_total=batch.history_items.shape[0]
        )
        return history_TM, targets_BM


class Scoring(nn.Module):
    """Each candidate reads its request's encoded history: `num_seeds` queries from the
    candidate's item token, by request-broadcast target attention (softmax) or by GDPA (the
    request's candidates' queries as one jagged sequence over its history)."""

    def __init__(self, config: ModelConfig, *, device: torch.device | None = None) -> None:
        super().__init__()
        h, s = config.history, config.scoring
        assert h is not None
        self.config, self.heads, self.head_dim = s, h.num_heads, h.head_dim
        inner = h.num_heads * h.head_dim
        self.kv = nn.Linear(h.model_dim, 2 * inner, device=device)
        self.seeds = nn.Linear(h.model_dim, s.num_seeds * inner, device=device)
        self.out = nn.Linear(inner, config.interaction.dim, device=device)

    def forward(
        self, batch: RequestBatch, history_TM: torch.Tensor, candidates_BM: torch.Tensor
    ) -> torch.Tensor:
        """-> [B, num_seeds, dim]."""
        s, shape = self.config, (-1, self.heads, self.head_dim)
        k_TI, v_TI = self.kv(history_TM).chunk(2, dim=1)
        k, v = k_TI.reshape(shape), v_TI.reshape(shape)
        q = self.seeds(candidates_BM).to(k.dtype)
        if s.attention == "target":
            out = target_attention(
                q.reshape(-1, s.num_seeds, self.heads, self.head_dim),
                k,
                v,
                batch.history_offsets,
                batch.cand_to_request,
                activation="softmax",
                max_candidates=batch.max_candidates,
                max_history=batch.max_history,
            )
        else:
            out = gdpa(
                q.reshape(shape),
                k,
                v,
                batch.candidate_offsets * s.num_seeds,
                batch.history_offsets,
                activation="gelu",
                max_q_len=batch.max_candidates * s.num_seeds,
                max_kv_len=batch.max_history,
            )
        return self.out(out.reshape(candidates_BM.shape[0], s.num_seeds, self.heads * self.head_dim))


class WukongLayer(nn.Module):
    """One Wukong layer over n embeddings of `dim`: a factorization-machine block (X (X^T Y),
    Y [n, rank], flattened, normed, an MLP to fm_outputs embeddings) beside a linear compress
    block (W X, W [compressed_outputs, n]); their outputs, plus X (projected over n where the
    count changes), normed.

    The input may come in two parts, the user's embeddings once per request and the
    candidate's: X = [X_u; X_c]. The factorization-machine block reads X_u from the request
    (kernels.ops.wukong_fm); the linear blocks are split, X_u's share computed once per request:
    W X = W_u X_u + W_c X_c."""

    def __init__(
        self,
        num_in: int,
        dim: int,
        *,
        rank: int,
        fm_outputs: int,
        compressed_outputs: int,
        mlp_dims: Sequence[int],
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.num_in, self.dim, self.fm_outputs = num_in, dim, fm_outputs
        self.num_out = fm_outputs + compressed_outputs
        self.fm_proj = nn.Parameter(torch.randn(num_in, rank, device=device) / num_in**0.5)
        self.fm_norm = nn.LayerNorm(num_in * rank, device=device)
        self.fm_mlp = mlp(num_in * rank, [*mlp_dims, fm_outputs * dim], last_activation=False, device=device)
        self.compress = nn.Parameter(torch.randn(compressed_outputs, num_in, device=device) / num_in**0.5)
        self.residual = (
            nn.Parameter(torch.randn(self.num_out, num_in, device=device) / num_in**0.5)
            if self.num_out != num_in
            else None
        )
        self.norm = nn.LayerNorm(dim, device=device)

    def forward(
        self,
        x_BCD: torch.Tensor,
        x_RUD: torch.Tensor | None = None,
        cand_to_request: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x_BCD: the candidates' embeddings [B, n_c, dim]; x_RUD: the user's, once per request
        [R, n_u, dim] (cand_to_request [B] names each candidate's request) -> [B, n_out, dim]."""
        n_u = 0 if x_RUD is None else x_RUD.shape[1]
        if n_u + x_BCD.shape[1] != self.num_in:
            raise ValueError(f"Wukong layer of {self.num_in} embeddings got {n_u} + {x_BCD.shape[1]}")
        dtype = compute_dtype(x_BCD)
        x_BCD = x_BCD.to(dtype)
        x_RUD = None if x_RUD is None else x_RUD.to(dtype)
        # X (X^T Y), the user's rows read from the request (kernels.ops.wukong_fm).
        fm_BNK = wukong_fm(x_BCD, self.fm_proj.to(dtype), x_RUD, None if x_RUD is None else cand_to_request)
        compressed = self._mix(self.compress, n_u, x_BCD)
        residual = self._mix(self.residual, n_u, x_BCD) if self.residual is not None else x_BCD
        if x_RUD is not None:
            assert cand_to_request is not None
            # The user's share of the linear blocks, once per request, then broadcast.
            compressed = compressed + self._user_share(self.compress, x_RUD)[cand_to_request]
            if self.residual is not None:
                residual = residual + self._user_share(self.residual, x_RUD)[cand_to_request]
            else:
                residual = torch.cat([x_RUD[cand_to_request], residual], dim=1)
        fm = self.fm_mlp(self.fm_norm(fm_BNK.flatten(1))).view(-1, self.fm_outputs, self.dim)
        return self.norm(torch.cat([fm, compressed.to(fm.dtype)], dim=1) + residual)

    @staticmethod
    def _user_share(weight: torch.Tensor, x_RUD: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ln,rnd->rld", weight[:, : x_RUD.shape[1]].to(x_RUD.dtype), x_RUD)

    @staticmethod
    def _mix(weight: torch.Tensor, n_u: int, x_BCD: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ln,bnd->bld", weight[:, n_u:].to(x_BCD.dtype), x_BCD)


class MixtureOfExperts(nn.Module):
    """Top-k routing over `num_experts` two-layer experts, each layer one `grouped_gemm` call
    (the routed rows sorted by expert, one matrix per expert), with the switch load-balancing
    loss. `group` (set for data-parallel training): the ranks whose parts of a batch make one
    batch; in training the loss's two batch statistics (the share routed to each expert, the mean
    routing probability) are then the whole batch's, summed over the ranks (differentiably), so
    the term is the one a single process takes on the whole batch."""

    group: dist.ProcessGroup | None = None

    def __init__(self, in_dim: int, num_experts: int, top_k: int, expert_dim: int, *, device=None) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(in_dim, num_experts, device=device)
        self.w1 = nn.Parameter(torch.randn(num_experts, in_dim, expert_dim, device=device) / in_dim**0.5)
        self.b1 = nn.Parameter(torch.zeros(num_experts, expert_dim, device=device))
        self.w2 = nn.Parameter(
            torch.randn(num_experts, expert_dim, expert_dim, device=device) / expert_dim**0.5
        )
        self.b2 = nn.Parameter(torch.zeros(num_experts, expert_dim, device=device))

    def forward(self, x_BF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (mixed expert outputs [B, expert_dim], load-balancing loss)."""
        probs_BE = torch.softmax(self.gate(x_BF).float(), dim=-1)
        top_p, top_e = probs_BE.topk(self.top_k, dim=-1)
        weights = top_p / top_p.sum(-1, keepdim=True)
        flat_e = top_e.flatten()
        order = torch.argsort(flat_e, stable=True)
        counts = F.one_hot(flat_e, self.num_experts).sum(0)
        offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=x_BF.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        dtype = compute_dtype(x_BF)
        rows = x_BF[order // self.top_k].to(dtype)
        # Every expert's rows through one grouped call per layer (no sync for the group sizes).
        hidden = F.relu(grouped_gemm(rows, offsets, self.w1.to(dtype), self.b1.to(dtype)))
        out = grouped_gemm(hidden, offsets, self.w2.to(dtype), self.b2.to(dtype))
        routed = torch.empty_like(out).index_copy_(0, order, out).view(-1, self.top_k, out.shape[-1])
        mixed = (routed * weights.unsqueeze(-1).to(routed.dtype)).sum(1)
        routed = torch.cat([counts.float(), torch.full((1,), float(x_BF.shape[0]), device=x_BF.device)])
        probs_sum = probs_BE.sum(0)
        if self.group is not None and self.training:
            dist.all_reduce(routed, group=self.group)  # each expert's rows, and the batch's, over the ranks
            probs_sum = sum_over_ranks(probs_sum, self.group)
        rows = routed[-1]
        fraction = routed[:-1] / (rows * self.top_k)
        balance = self.num_experts * (fraction * probs_sum / rows).sum()
        return mixed, balance


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matrix products run in here: autocast's where it is on (custom ops are not cast
    by it), else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


@dataclass
class Output:
    logits: torch.Tensor  # [B, tasks]
    balance_loss: torch.Tensor  # scalar (zero without experts)


class GEMModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        sharding: Sharding | None = None,
    ) -> None:
        """`sharding`: the tables sharded over a process group's ranks (model.sharding), for
        data-parallel training; None keeps every table here."""
        super().__init__()
        device = torch.device(device) if device is not None else None
        self.config = c = config
        self.sparse = SparseArch(c, device=device, sharding=sharding)
        dim = c.interaction.dim
        self.dense = nn.Linear(c.data.num_dense, dim, device=device)
        self.history: HistoryEncoder | None = None
        self.scoring: Scoring | None = None
        self.target_out: nn.Linear | None = None
        self.candidate_feature: FeatureConfig | None = None
        # Embeddings: the user's features; the candidate's features, seeds, target token, dense.
        n_user, n_item = len(c.features_of("user")), len(c.features_of("item")) + 1
        if c.history is not None:
            self.candidate_feature = candidate_item_feature(c)
            self.history = HistoryEncoder(c, device=device)
            self.scoring = Scoring(c, device=device)
            n_item += c.scoring.num_seeds
            if c.history.candidates_as_targets:
                self.target_out = nn.Linear(c.history.model_dim, dim, device=device)
                n_item += 1
        i = c.interaction
        layers, n = [], n_user + n_item
        for _ in range(i.num_layers):
            layers.append(
                WukongLayer(
                    n,
                    dim,
                    rank=i.fm_rank,
                    fm_outputs=i.fm_outputs,
                    compressed_outputs=i.compressed_outputs,
                    mlp_dims=i.mlp_dims,
                    device=device,
                )
            )
            n = layers[-1].num_out
        self.interaction = nn.ModuleList(layers)
        flat = n * dim
        h = c.heads
        self.experts = None
        if h.num_experts:
            self.experts = MixtureOfExperts(flat, h.num_experts, h.top_k, h.expert_dim, device=device)
            flat = h.expert_dim
        self.towers = nn.ModuleList(
            nn.Sequential(mlp(flat, h.mlp_dims, device=device), nn.Linear(h.mlp_dims[-1], 1, device=device))
            for _ in h.tasks
        )

    def user_tower(
        self, batch: RequestBatch, candidates_BM: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """What depends only on the user, once per request: (user embeddings [R, n_u, dim], or
        None without user features; the encoded history [T, model_dim], or None without one;
        the candidates' encoded tokens where they join the history as targets, else None).
        candidates_BM: the candidates' item tokens."""
        user = self.sparse(batch.user_features, "user", batch.num_requests)
        if self.history is None or self.config.history is None:
            return user, None, None
        items = self.sparse.embeddings.gather(
            self.config.history.item_table, batch.history_items, batch.history_offsets
        )
        if candidates_BM is None:
            candidates_BM = self.candidate_tokens(batch)
        history_TM, targets_BM = self.history(batch, items, candidates_BM)
        return user, history_TM, targets_BM

    def candidate_tokens(self, batch: RequestBatch) -> torch.Tensor:
        """Each candidate's item as a history token (its row of the unified item table)."""
        assert self.history is not None and self.candidate_feature is not None
        f = self.candidate_feature
        ids = batch.item_features[f.name].ids.remainder(self.config.hash_size(f))
        return self.history.item_proj(self.sparse.lookup(f.table, ids))

    def forward(self, batch: RequestBatch) -> Output:
        candidates_BM = self.candidate_tokens(batch) if self.history is not None else None
        user_RUD, history_TM, targets_BM = self.user_tower(batch, candidates_BM)
        parts = [self.sparse(batch.item_features, "item", batch.num_candidates)]
        if self.scoring is not None:
            assert history_TM is not None and candidates_BM is not None
            parts.append(self.scoring(batch, history_TM, candidates_BM))
        if targets_BM is not None:
            assert self.target_out is not None
            parts.append(self.target_out(targets_BM).unsqueeze(1))
        parts.append(self.dense(batch.dense).unsqueeze(1))
        dtype = parts[-1].dtype  # the matrix work's (bf16 under autocast)
        x = torch.cat([p.to(dtype) for p in parts], dim=1)
        x = self.interaction[0](x, user_RUD, batch.cand_to_request)
        for layer in self.interaction[1:]:
            x = layer(x)
        flat = x.flatten(1)
        balance = flat.new_zeros((), dtype=torch.float32)
        if self.experts is not None:
            flat, balance = self.experts(flat)
        logits = torch.cat([tower(flat) for tower in self.towers], dim=1)
        return Output(logits=logits.float(), balance_loss=balance)

    def naive_forward(self, batch: RequestBatch) -> Output:
        """The same scores with the user work repeated for every candidate (each candidate in
        its own copy of its request): the baseline of request-oriented serving."""
        with_all = self.config.history is not None and self.config.history.candidates_as_targets
        copies, pick = batch.per_candidate_requests(with_all_candidates=with_all)
        out = self.forward(copies)
        return Output(logits=out.logits[pick], balance_loss=out.balance_loss)

    def loss(self, batch: RequestBatch, output: Output | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(Binary cross-entropy per task, averaged, plus the weighted load-balancing loss; the
        per-task losses [tasks])."""
        output = output if output is not None else self(batch)
        per_task = F.binary_cross_entropy_with_logits(output.logits, batch.labels, reduction="none").mean(0)
        loss = per_task.mean() + self.config.heads.balance_weight * output.balance_loss
        return loss, per_task

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The tables where their optimizer steps them (unfused): the flat buffer of every table
        (its layout: self.sparse.embeddings.table_layout()); fused, none (their backward steps
        them)."""
        embeddings = self.sparse.embeddings
        return [] if embeddings.fused else [embeddings.weights]

    def dense_parameters(self) -> list[nn.Parameter]:
        tables = {id(p) for p in self.embedding_parameters()}
        return [p for p in self.parameters() if id(p) not in tables]


def candidate_item_feature(config: ModelConfig) -> FeatureConfig:
    """The item feature that names the candidate's item: a single-id feature of the history's
    item table (its row is the candidate's token in the history's space)."""
    assert config.history is not None
    for f in config.features_of("item"):
        if f.table == config.history.item_table and f.max_bag == 1:
            return f
    raise ValueError(
        f"a model with a history needs an item feature of one id from table {config.history.item_table!r} "
        "(the candidate's item)"
    )
