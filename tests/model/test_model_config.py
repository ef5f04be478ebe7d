"""The model config: presets, overrides key by key, and every bad key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.config import SIZES, ModelConfig, config_from_dict, load_config


@pytest.mark.parametrize("size", SIZES)
def test_every_preset_loads(size: str) -> None:
    config = load_config(size)
    assert isinstance(config, ModelConfig) and config.name == size
    assert config.features_of("item") and config.history is not None


def test_the_large_preset_has_the_workloads_shapes() -> None:
    c = load_config("large")
    assert len(c.features) >= 20 and {t.dim for t in c.tables} >= {64, 128}
    assert sum(f.max_bag <= 3 for f in c.features) > len(c.features) / 2  # most hold 1 to 3 ids
    assert max(f.max_bag for f in c.features) == 120
    h = c.history
    assert (h.model_dim, h.num_heads, h.head_dim, h.median_len, h.max_len) == (512, 4, 128, 500, 4096)
    i = c.interaction
    assert (i.dim, i.fm_rank, i.compressed_outputs, i.mlp_dims) == (128, 24, 16, [512, 512])
    assert (c.heads.num_experts, c.heads.top_k, c.heads.tasks) == (8, 2, ["ctr", "cvr"])
    assert (c.data.serve_requests, c.data.serve_candidates) == (15, 70)


def test_a_file_overrides_its_preset_key_by_key(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('size = "tiny"\nname = "mine"\n[history]\nnum_layers = 3\n[train]\nsteps = 7\n')
    config = load_config(path)
    tiny = load_config("tiny")
    assert config.name == "mine" and config.history.num_layers == 3 and config.train.steps == 7
    assert config.history.model_dim == tiny.history.model_dim and config.tables == tiny.tables


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"history": {"num_layer": 2}}, r"config\.history: unknown key\(s\) \['num_layer'\]"),
        ({"history": {"num_layers": "two"}}, r"config\.history\.num_layers: expected int"),
        ({"history": {"head_dim": 24}}, "head_dim must be a power of two"),
        ({"history": {"attention": "relu"}}, r"attention: must be one of \('silu', 'softmax'\)"),
        ({"history": {"item_table": "nope"}}, "no table 'nope'"),
        ({"heads": {"num_experts": 2, "top_k": 3}}, "top_k 3 exceeds num_experts 2"),
        ({"heads": {"tasks": ["ctr", "ltv"]}}, "tasks must be among"),
        ({"data": {"requests_per_batch": 0}}, "requests_per_batch must be > 0"),
        ({"size": "huge"}, "size must be one of"),
        ({"interaction": {"mlp_dims": 5}}, r"mlp_dims: expected a list"),
    ],
)
def test_bad_keys_are_named(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config_from_dict({"size": "tiny", **override})


def test_features_are_checked_against_their_tables() -> None:
    tiny = load_config("tiny").to_dict()
    tables, features = tiny["tables"], tiny["features"]
    with pytest.raises(ValueError, match="hash_size 5000 exceeds table 'categorical'"):
        config_from_dict({**tiny, "features": [*features, {**features[1], "name": "x", "hash_size": 5000}]})
    with pytest.raises(ValueError, match="feature names must be unique"):
        config_from_dict({**tiny, "features": [*features, features[0]]})
    single_item = [f for f in features if f["name"] != "item_id"]
    with pytest.raises(ValueError, match="the candidates need an item feature of one id from table 'items'"):
        config_from_dict({**tiny, "features": single_item})
    with pytest.raises(ValueError, match="at least one item feature"):
        config_from_dict({**tiny, "history": None, "features": [f for f in features if f["side"] == "user"]})
    assert config_from_dict({**tiny, "tables": tables}).to_dict() == tiny


def test_a_missing_or_broken_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no model config at"):
        load_config(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[history\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(broken)
