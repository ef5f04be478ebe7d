"""Whether the first timing after the host's own work runs slow, and whether `benchmark`'s
warm-up (sandbox.timing.WARMUP_MS) removes it. For each op and timing shape: inputs drawn, the
host idle for a second (as while drawing a shape's inputs or compiling), then the op's default
kernel timed three times in a row, once with the old warm-up (three calls) and once with the
time-bounded one, in alternating order. Prints each median and the first timing over the third.

    python3 -m evals.studies.warmup [OP ...]
"""

from __future__ import annotations

import time

import torch

from evals.studies import default_at_each_shape, each_op
from sandbox.timing import WARMUP_MS, benchmark

OPS = ("jagged_to_padded_dense", "dense_to_jagged", "embedding_bags", "embedding_bags_update")
IDLE_S = 1.0


def study(name: str) -> None:
    device = torch.device("cuda")
    heads = " ".join(f"{h:>9}" for h in ("1st us", "2nd us", "3rd us", "1st/3rd"))
    print(f"\n{name}\n  {'shape':28} {'dtype':5} {'warm-up':>8} {heads}")
    for n, (shape, fn, sets) in enumerate(default_at_each_shape(name)):
        # The order alternates between shapes, so neither warm-up always runs first.
        order = (0.0, WARMUP_MS) if n % 2 else (WARMUP_MS, 0.0)
        for warmup in order:
            torch.cuda.synchronize(device)
            time.sleep(IDLE_S)
            t = [
                benchmark(fn, sets, device=device, joined_streams=True, warmup_ms=warmup).median_us
                for _ in range(3)
            ]
            cells = " ".join(f"{x:9.1f}" for x in t)
            print(f"  {shape.name:28} {shape.dtype:5} {warmup:>6.0f}ms {cells} {t[0] / t[2]:9.2f}")


if __name__ == "__main__":
    each_op(study, OPS)
