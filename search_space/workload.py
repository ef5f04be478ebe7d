"""Realistic shapes of a GEM-class ads ranking model, kept in one place.

Figures follow published descriptions of table-batched embeddings and large ads rankers
(see shared WORKLOAD notes): tables of 1e6 to 1e8 rows, D in {64, 128}, bags of 1 to 120 ids
with power-law lengths, 64k to 256k bags per step.
"""

from __future__ import annotations

# Sparse features (pooled embedding bags).
EMBEDDING_DIMS = (64, 128)
BAG_LENGTH_MAX = 120
# Exponent of the truncated power law P(L) ~ L^-a over 1..BAG_LENGTH_MAX; 1.1 gives a mean
# bag of about 19 ids with a long tail, close to production pooling factors.
BAG_LENGTH_ALPHA = 1.1
TABLE_ROWS_TIMING = (1_000_000, 4_000_000)
NUM_BAGS_TIMING = (65_536, 262_144)
