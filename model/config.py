"""The GEM-class model's configuration: one schema, sizes from tiny to large.

A config is a TOML file. `size = "tiny" | "small" | "large"` starts from that preset
(model/configs/<size>.toml) and the file's own tables override it key by key, so a config names
only what it changes. Every key is checked: an unknown one, a wrong type or a value out of range
is a ValueError naming it. Defaults for the large preset are the workload's published shapes
(tens of features of dims 16 to 128 in unified tables, histories of median about 500 and at most
4096, four heads of 128, Wukong layers of rank 24 with 16 compressed outputs and an MLP of 2 x 512,
requests of about 70 candidates, CTR and CVR heads over eight experts with top-2 routing).
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

CONFIG_DIR = Path(__file__).parent / "configs"
SIZES = ("tiny", "small", "large")


def _positive(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{owner}: {name} must be > 0, got {value}")


def _one_of(owner: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}: {name} must be one of {allowed}, got {value!r}")


@dataclass(kw_only=True)
class TableConfig:
    """An embedding table: `num_rows` x `dim`. Several features may share it (unified
    embeddings), each hashing its ids into the first `hash_size` rows."""

    name: str
    num_rows: int
    dim: int

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"table name must be a Python identifier, got {self.name!r}")
        _positive(f"table {self.name!r}", num_rows=self.num_rows, dim=self.dim)


@dataclass(kw_only=True)
class FeatureConfig:
    """A categorical feature: a bag of ids per sample, pooled from `table`. A `user` feature has
    one bag per request (computed once, broadcast to the request's candidates); an `item`
    feature has one bag per candidate. Bags hold 1 to `max_bag` ids, power-law (most features
    hold one to three); `hash_size` (default: the table's rows) bounds the rows its ids reach."""

    name: str
    table: str
    side: Literal["user", "item"] = "item"
    max_bag: int = 1
    hash_size: int | None = None
    pooling: Literal["sum", "mean"] = "sum"
    weighted: bool = False

    def __post_init__(self) -> None:
        owner = f"feature {self.name!r}"
        if not self.name.isidentifier():
            raise ValueError(f"feature name must be a Python identifier, got {self.name!r}")
        _one_of(owner, "side", self.side, ("user", "item"))
        _one_of(owner, "pooling", self.pooling, ("sum", "mean"))
        _positive(owner, max_bag=self.max_bag)
        if self.hash_size is not None:
            _positive(owner, hash_size=self.hash_size)
        if self.weighted and self.pooling != "sum":
            raise ValueError(f"{owner}: weighted ids need pooling = 'sum'")


@dataclass(kw_only=True)
class HistoryConfig:
    """The user's history, (item id, action, timestamp) per event, embedded (the item from the
    unified `item_table`, the action and the time since the event from tables of their own) and
    encoded by HSTU layers; candidates attend to the encoded history."""

    item_table: str
    num_actions: int = 8
    time_buckets: int = 64
    model_dim: int = 512
    num_heads: int = 4
    head_dim: int = 128
    num_layers: int = 3
    attention: Literal["silu", "softmax"] = "silu"
    num_buckets: int = 32  # relative-position buckets of the attention bias
    median_len: int = 500
    max_len: int = 4096
    # The request's candidates join its history as HSTU targets (they see the history and
    # themselves, not each other); each candidate's encoded token is one more feature. The
    # attention's length bound (its silu normalizer too) is then max_len + max_targets.
    candidates_as_targets: bool = False
    max_targets: int = 256

    def __post_init__(self) -> None:
        owner = "history"
        _one_of(owner, "attention", self.attention, ("silu", "softmax"))
        _positive(
            owner,
            num_actions=self.num_actions,
            time_buckets=self.time_buckets,
            model_dim=self.model_dim,
            num_heads=self.num_heads,
            num_layers=self.num_layers,
            median_len=self.median_len,
            max_len=self.max_len,
            max_targets=self.max_targets,
        )
        if self.head_dim < 16 or self.head_dim & (self.head_dim - 1):
            raise ValueError(f"{owner}: head_dim must be a power of two >= 16, got {self.head_dim}")
        half = self.num_buckets // 2
        if self.num_buckets < 2 or half & (half - 1):
            raise ValueError(f"{owner}: num_buckets must be twice a power of two, got {self.num_buckets}")
        if self.median_len > self.max_len:
            raise ValueError(f"{owner}: median_len {self.median_len} exceeds max_len {self.max_len}")


@dataclass(kw_only=True)
class ScoringConfig:
    """How candidates read the encoded history: `target` (request-broadcast target attention
    of `num_seeds` queries per candidate) or `gdpa` (the request's candidates as one jagged
    query sequence over its history)."""

    attention: Literal["target", "gdpa"] = "target"
    num_seeds: int = 2

    def __post_init__(self) -> None:
        _one_of("scoring", "attention", self.attention, ("target", "gdpa"))
        _positive("scoring", num_seeds=self.num_seeds)


@dataclass(kw_only=True)
class InteractionConfig:
    """Wukong layers over the stacked feature embeddings, each of `dim`: a factorization-machine
    block (X (X^T Y) of rank `fm_rank`, flattened, normed, an MLP to `fm_outputs` embeddings)
    beside a linear compress block (`compressed_outputs` embeddings), residual and norm."""

    dim: int = 128
    num_layers: int = 2
    fm_rank: int = 24
    fm_outputs: int = 16
    compressed_outputs: int = 16
    mlp_dims: list[int] = field(default_factory=lambda: [512, 512])

    def __post_init__(self) -> None:
        owner = "interaction"
        _positive(
            owner,
            dim=self.dim,
            num_layers=self.num_layers,
            fm_rank=self.fm_rank,
            fm_outputs=self.fm_outputs,
            compressed_outputs=self.compressed_outputs,
        )
        if any(d <= 0 for d in self.mlp_dims):
            raise ValueError(f"{owner}: mlp_dims must be positive, got {self.mlp_dims}")

    @property
    def outputs(self) -> int:
        return self.fm_outputs + self.compressed_outputs


@dataclass(kw_only=True)
class HeadsConfig:
    """Multi-task heads (CTR, CVR) over the flattened interaction output; with `num_experts`,
    a sparse mixture of experts before them (top-`top_k` routing, a load-balancing loss)."""

    tasks: list[str] = field(default_factory=lambda: ["ctr", "cvr"])
    mlp_dims: list[int] = field(default_factory=lambda: [512, 256])
    num_experts: int = 0
    top_k: int = 2
    expert_dim: int = 512
    balance_weight: float = 0.01

    def __post_init__(self) -> None:
        owner = "heads"
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"{owner}: tasks must be a non-empty list of distinct names, got {self.tasks}")
        unknown = set(self.tasks) - {"ctr", "cvr"}
        if unknown:
            raise ValueError(f"{owner}: tasks must be among ('ctr', 'cvr'), got {sorted(unknown)}")
        if not self.mlp_dims or any(d <= 0 for d in self.mlp_dims):
            raise ValueError(
                f"{owner}: mlp_dims must be a non-empty list of positive sizes, got {self.mlp_dims}"
            )
        if self.num_experts < 0:
            raise ValueError(f"{owner}: num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            _positive(owner, top_k=self.top_k, expert_dim=self.expert_dim)
            if self.top_k > self.num_experts:
                raise ValueError(f"{owner}: top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.balance_weight < 0:
            raise ValueError(f"{owner}: balance_weight must be >= 0, got {self.balance_weight}")


@dataclass(kw_only=True)
class DataConfig:
    """The synthetic traffic: requests of power-law histories and about `candidates_per_request`
    candidates (a training batch holds `requests_per_batch` requests), `num_dense` dense
    features per candidate, labels from a hidden ground-truth model. A serving batch holds
    `serve_requests` requests of about `serve_candidates` candidates."""

    requests_per_batch: int = 256
    candidates_per_request: int = 32
    num_dense: int = 16
    # A serving batch: about 15 requests of about 70 candidates (about 1024 candidates).
    serve_requests: int = 15
    serve_candidates: int = 70
    # Exponent of the power law of bag and history lengths (P(L) ~ L^-a).
    length_alpha: float = 1.1
    # The hidden model's signal strength: larger, an easier task (AUC nearer 1).
    signal: float = 1.5

    def __post_init__(self) -> None:
        _positive(
            "data",
            requests_per_batch=self.requests_per_batch,
            candidates_per_request=self.candidates_per_request,
            num_dense=self.num_dense,
            serve_requests=self.serve_requests,
            serve_candidates=self.serve_candidates,
            length_alpha=self.length_alpha,
            signal=self.signal,
        )


@dataclass(kw_only=True)
class TrainConfig:
    """AdamW for dense parameters, row-wise Adagrad for the embedding tables: fused into the
    backward (each looked-up row stepped once, in place, no dense gradient), or unfused (a
    dense gradient, then the optimizer's step), the same math (model.embeddings)."""

    steps: int = 1000
    lr: float = 1e-3
    weight_decay: float = 0.01
    embedding_lr: float = 0.05
    embedding_update: Literal["fused", "unfused"] = "fused"
    autocast: bool = True  # bf16 autocast where the device supports it
    compile: bool = False
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(
            "train",
            steps=self.steps,
            lr=self.lr,
            embedding_lr=self.embedding_lr,
            eval_every=self.eval_every,
            eval_batches=self.eval_batches,
            checkpoint_every=self.checkpoint_every,
        )
        if self.weight_decay < 0:
            raise ValueError(f"train: weight_decay must be >= 0, got {self.weight_decay}")
        _one_of("train", "embedding_update", self.embedding_update, ("fused", "unfused"))


@dataclass(kw_only=True)
class ModelConfig:
    name: str
    tables: list[TableConfig]
    features: list[FeatureConfig]
    history: HistoryConfig | None = None
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    interaction: InteractionConfig = field(default_factory=InteractionConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        tables = {t.name: t for t in self.tables}
        if len(tables) != len(self.tables):
            raise ValueError(f"table names must be unique, got {[t.name for t in self.tables]}")
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be unique, got {names}")
        if not any(f.side == "item" for f in self.features):
            raise ValueError("a model needs at least one item feature (candidates must differ)")
        for f in self.features:
            if f.table not in tables:
                raise ValueError(f"feature {f.name!r}: no table {f.table!r}; tables: {sorted(tables)}")
            rows = tables[f.table].num_rows
            if f.hash_size is not None and f.hash_size > rows:
                raise ValueError(
                    f"feature {f.name!r}: hash_size {f.hash_size} exceeds table {f.table!r}'s {rows} rows"
                )
        if self.history is not None:
            item_table = self.history.item_table
            if item_table not in tables:
                raise ValueError(f"history: no table {item_table!r}; tables: {sorted(tables)}")
            if not any(f.side == "item" and f.table == item_table and f.max_bag == 1 for f in self.features):
                raise ValueError(
                    f"history: the candidates need an item feature of one id from table {item_table!r} "
                    "(the candidate's item, its token in the history's space)"
                )

    def table(self, name: str) -> TableConfig:
        return next(t for t in self.tables if t.name == name)

    def hash_size(self, feature: FeatureConfig) -> int:
        return feature.hash_size if feature.hash_size is not None else self.table(feature.table).num_rows

    def features_of(self, side: str) -> list[FeatureConfig]:
        return [f for f in self.features if f.side == side]

    @property
    def tasks(self) -> list[str]:
        return self.heads.tasks

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- loading ---------------------------------------------------------------------------------


def _build(cls: type, data: Any, where: str) -> Any:
    """An instance of dataclass `cls` from plain data, every key and type checked."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    values = {name: _value(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    missing = [
        n for n, f in fields.items()
        if n not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]  # fmt: skip
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    return cls(**values)


def _value(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        if value is None:
            return None
        return _value(members[0], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_value(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{where}: must be one of {typing.get_args(hint)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`, table by table; lists (tables, features) are replaced whole."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(data: dict[str, Any], where: str = "config") -> ModelConfig:
    """A ModelConfig from a parsed TOML document (with an optional `size` preset under it)."""
    data = dict(data)
    size = data.pop("size", None)
    if size is not None:
        if size not in SIZES:
            raise ValueError(f"{where}: size must be one of {SIZES}, got {size!r}")
        data = _merge(_read(CONFIG_DIR / f"{size}.toml"), data)
    data.setdefault("name", size or "custom")
    try:
        return _build(ModelConfig, data, where)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") if not str(exc).startswith(where) else exc from None


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"no model config at {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None


def load_config(path_or_size: str | Path) -> ModelConfig:
    """A config file, or the name of a preset ("tiny", "small", "large")."""
    if str(path_or_size) in SIZES:
        return config_from_dict({"size": str(path_or_size)}, where=str(path_or_size))
    path = Path(path_or_size)
    return config_from_dict(_read(path), where=str(path))
