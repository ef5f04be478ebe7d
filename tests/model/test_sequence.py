"""The user-history encoder and target attention train through the kernel library's attention
ops and compute what the plain PyTorch references compute."""

from __future__ import annotations

import copy

import pytest
import torch

import model.sequence as sequence_module
from kernels.registry import DISPATCHER
from model import RecommenderConfig, SequenceConfig, SparseFeatureConfig, make_synthetic_batch, train_step
from search_space.attention import jagged_attention_reference, target_attention_reference

CONFIG = RecommenderConfig(
    sparse_features=[SparseFeatureConfig(name="user_ids", num_rows=50, dim=16)],
    num_dense_features=3,
    dense_mlp_dims=[8],
    interaction_mlp_dims=[16],
    # Tiny: interpreted Triton on a CPU. Histories up to 24 tokens, blocks of 16: partial tiles.
    sequence=SequenceConfig(
        num_items=100, model_dim=16, num_heads=2, head_dim=16, num_layers=2, max_seq_len=24, num_seeds=2
    ),
)


def _batch(device: torch.device, seed: int = 0):
    return make_synthetic_batch(CONFIG, 12, seed, device)


def test_training_step_reaches_every_parameter_through_the_attention_ops(device: torch.device) -> None:
    torch.manual_seed(0)
    model = CONFIG.build(device)
    batch = _batch(device)
    assert batch.history is not None and int(batch.history.offsets[-1]) > 0
    before = DISPATCHER.calls.copy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = train_step(model, batch, optimizer)
    assert torch.isfinite(torch.tensor(loss))
    used = {op for op, _ in DISPATCHER.calls - before}
    assert {"jagged_attention", "target_attention"} <= used
    arch = model.sequence_arch
    for name, p in arch.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"


def _reference_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Swap the model's attention calls for the plain PyTorch references (autograd through them)."""
    monkeypatch.setattr(sequence_module, "jagged_attention", jagged_attention_reference)
    monkeypatch.setattr(
        sequence_module,
        "target_attention",
        lambda q, k, v, off, c2r, *, activation: target_attention_reference(
            q, k, v, off, c2r, activation=activation
        ),
    )


def test_sequence_features_match_the_reference_math(device: torch.device, monkeypatch) -> None:
    torch.manual_seed(1)
    arch = CONFIG.build(device).sequence_arch
    with torch.no_grad():  # a bias that matters, so the bucket math is exercised
        for layer in arch.layers:
            layer.rel_bias.normal_()
    twin = copy.deepcopy(arch)
    history = _batch(device, seed=3).history
    out = arch(history)
    out.square().sum().backward()
    with monkeypatch.context() as patch:
        _reference_ops(patch)
        want = twin(history)
        want.square().sum().backward()
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    for (name, got), (_, ref) in zip(arch.named_parameters(), twin.named_parameters(), strict=True):
        torch.testing.assert_close(got.grad, ref.grad, atol=1e-4, rtol=1e-3, msg=f"gradient of {name}")


def test_a_sequence_model_needs_histories(device: torch.device) -> None:
    model = CONFIG.build(device)
    batch = _batch(device)
    with pytest.raises(ValueError, match="history"):
        model(batch.dense_BF, batch.sparse)
