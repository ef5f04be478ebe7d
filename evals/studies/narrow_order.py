"""Why a batch with one narrow feature looks up slower, and whether the order of the lookup's
blocks helps: the forward kernel by the profiler (device time; lookup_profile.py) at
b64k-f26-short with one more short feature of D columns (D = 4, 8, 12, 16 beside none), at the
other timing shapes with one of 4, and at every timing shape, for the default module
and other versions of it, alternately, three times. Each version's output is compared with the
default's (equal to the bit: the same sums, stored by other programs).

A narrow feature shifts the rows of odd samples: by 8 bytes for D = 4 or 12 (the 8-byte store
path), by 16 for D = 8 (16-byte vectors still, but a row's features then start and end inside
32-byte sectors, written by different programs), not at all for D = 16. Comparing D = 4, 8 and
16 separates the cost of 8-byte stores from that of part-written sectors.

    python3 -m evals.studies.narrow_order evals.studies._bags_other[,OTHERS]

One CUDA device; rows print as they are measured.
"""

from __future__ import annotations

import importlib
import sys

import kernels.embedding_bags as kernel
from evals.studies.lookup_profile import beside
from search_space import get_problem
from search_space.problem import Shape


def with_features(shape: Shape, dims: list[int], first: int = 0) -> Shape:
    """`shape` with more short features (one to three ids), one per entry of `dims` and of as many
    columns, each on a table of its own of 10,000 rows (embedding_bags.with_narrow_feature, for
    any dims): the first `first` of them before the shape's features, the others after."""
    p = dict(shape.params)
    tables, features, lens = list(p["tables"]), list(p["features"]), list(p["max_lens"])
    for i, dim in enumerate(dims):
        tables.append([10_000, dim])
        at = i if i < first else len(features)
        features.insert(at, len(tables) - 1)
        lens.insert(at, 3)
    p |= {"tables": tables, "features": features, "max_lens": lens}
    where = f"{first} first" if first else "after"
    return Shape.of(f"{shape.name}+d{'+d'.join(map(str, dims))} ({where})", shape.dtype, **p)


def shapes() -> list[Shape]:
    """The narrow features after b64k-f26-short's (D = 4, 8, 12, 16), and four of 4 columns, one
    before the others (every later feature's columns off by 8 bytes, the rows' stride not), then
    one of 4 after each other timing shape's (fp32's: 16 bytes), then the timing shapes."""
    timing = get_problem("embedding_bags").timing_shapes
    base = timing[0]
    narrow = [with_features(base, [dim]) for dim in (4, 8, 12, 16)]
    narrow.append(with_features(base, [4, 4, 4, 4], first=1))
    narrow += [with_features(s, [4]) for s in timing[2:]]
    return [*narrow, *timing]


def main(others: str) -> None:
    versions = [("default", kernel)]
    for name in filter(None, others.split(",")):
        versions.append((name.rsplit(".", 1)[-1], importlib.import_module(name)))
    beside(versions, shapes(), check=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
