"""Evaluation metrics of a click model."""

from __future__ import annotations

import math

import torch


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the probability that a random positive scores above a random
    negative (ties count one half), by the rank-sum formula. NaN without both classes."""
    scores = scores.detach().double().flatten().cpu()
    labels = labels.detach().flatten().cpu() > 0.5
    if scores.shape != labels.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} differ in shape")
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return math.nan
    order = torch.argsort(scores)
    _, inverse, counts = torch.unique(scores[order], return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = ((ends - counts + 1 + ends) / 2)[inverse]  # 1-based, ties averaged
    rank_sum = float(ranks[labels[order]].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))
