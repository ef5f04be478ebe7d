"""Realistic shapes of a GEM-class ads ranking model, kept in one place.

Figures follow published descriptions of table-batched embeddings and large ads rankers
(see shared WORKLOAD notes): tables of 1e6 to 1e8 rows, D in {64, 128}, bags of 1 to 120 ids
with power-law lengths, 64k to 256k bags per step; attention over user histories of power-law
length (median about 500, max 4096, up to 16k), 4 heads of dim 128.
"""

from __future__ import annotations

import math

# Sparse features (pooled embedding bags).
EMBEDDING_DIMS = (64, 128)
BAG_LENGTH_MAX = 120
# Exponent of the truncated power law P(L) ~ L^-a over 1..BAG_LENGTH_MAX; 1.1 gives a mean
# bag of about 19 ids with a long tail, close to production pooling factors.
BAG_LENGTH_ALPHA = 1.1
TABLE_ROWS_TIMING = (1_000_000, 4_000_000)
NUM_BAGS_TIMING = (65_536, 262_144)

# Attention family: HSTU-style jagged self-attention, GDPA and request-broadcast target attention
# (published HSTU, GDPA and request-oriented inference figures; see shared WORKLOAD notes).
ATTENTION_HEADS = 4
ATTENTION_HEAD_DIM = 128
HSTU_BATCH = (256, 512)  # user sequences per GPU in a training step
HSTU_MAX_LEN = (1024, 4096)
HSTU_LONG_MAX_LEN = 8192
TRAINING_TARGETS = 32  # candidates appended to each user sequence in a training batch
REL_BIAS_BUCKETS = 32
GDPA_BATCH = 1024
GDPA_MAX_LEN = (256, 2048)
GDPA_SPARSITY = (0.5, 1.0)  # mean length / max length
GDPA_CROSS_KV_LEN = 256
GDPA_SEEDS = (32, 256)  # learned query seeds shared by every sample
SERVING_REQUESTS = 15
SERVING_CANDIDATES_PER_REQUEST = 70
TARGET_SEEDS = (32, 256)
TARGET_HISTORY = (400, 2000)
SERVING_ONE_REQUEST_CANDIDATES = 2048
SERVING_LONG_HISTORY = 16384

# Sequence-length distributions over [0, max_len], each given by its inverse CDF so that a batch
# can be drawn at random (check shapes) or as the fixed quantiles (i + 1/2) / B (timing shapes:
# the same multiset of lengths every time, so FLOP counts are exact and compiled baselines see
# one shape; only the order changes with the seed).
#   fixed:   every sequence has max_len.
#   uniform: integers in [ceil(min_frac * max_len), max_len]; min_frac 0.9 is "near-uniform",
#            and a GDPA sparsity s (mean / max) is min_frac = 2s - 1.
#   power:   density proportional to L^(-2/3), L = floor((max_len + 1) * u^3): a truncated power
#            law whose median is max_len / 8 (512 at 4096) and mean max_len / 4, like user
#            histories (median about 500, max 4096); about 6% of a batch is empty.
LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "power")
NEAR_UNIFORM_MIN_FRAC = 0.9
POWER_LAW_CUBE = 3


def _uniform_low(max_len: int, min_frac: float) -> int:
    return min(max_len, max(0, math.ceil(min_frac * max_len - 1e-9)))


def length_at(u: float, dist: str, max_len: int, min_frac: float = NEAR_UNIFORM_MIN_FRAC) -> int:
    """The length at quantile u in [0, 1) of a distribution (see LENGTH_DISTRIBUTIONS)."""
    if dist == "fixed":
        return max_len
    if dist == "uniform":
        low = _uniform_low(max_len, min_frac)
        return min(max_len, low + math.floor(u * (max_len - low + 1)))
    if dist == "power":
        return min(max_len, math.floor((max_len + 1) * u**POWER_LAW_CUBE))
    raise ValueError(f"unknown length distribution {dist!r}; known: {', '.join(LENGTH_DISTRIBUTIONS)}")


def quantile_lengths(num: int, dist: str, max_len: int, min_frac: float = NEAR_UNIFORM_MIN_FRAC) -> list[int]:
    """The num lengths at quantiles (i + 1/2) / num, ascending: a batch without sampling noise."""
    return [length_at((i + 0.5) / num, dist, max_len, min_frac) for i in range(num)]


def length_pmf(dist: str, max_len: int, min_frac: float = NEAR_UNIFORM_MIN_FRAC) -> list[tuple[int, float]]:
    """(length, probability) of one length drawn at random from the distribution."""
    if dist == "fixed":
        return [(max_len, 1.0)]
    if dist == "uniform":
        low = _uniform_low(max_len, min_frac)
        return [(n, 1.0 / (max_len - low + 1)) for n in range(low, max_len + 1)]
    if dist == "power":
        # P(L <= n) = ((n + 1) / (max_len + 1))^(1/3) for n < max_len.
        cdf = [((n + 1) / (max_len + 1)) ** (1 / POWER_LAW_CUBE) for n in range(max_len)] + [1.0]
        return [(n, c - (cdf[n - 1] if n else 0.0)) for n, c in enumerate(cdf)]
    raise ValueError(f"unknown length distribution {dist!r}; known: {', '.join(LENGTH_DISTRIBUTIONS)}")
