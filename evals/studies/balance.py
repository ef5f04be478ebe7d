"""How evenly data-parallel ranks share a global batch, split into consecutive blocks (no
shuffle) or balanced by attention work (`model.balance.balanced_parts`): for W = 2, 4, 8 ranks,
the heaviest rank's attention work and candidates over the mean rank's, on batch 0 of a config
and over its first batches (mean and worst). Host only.

    python3 -m evals.studies.balance [CONFIG (default large)] [NUM_BATCHES (default 16)]
"""

from __future__ import annotations

import statistics
import sys
import time

from model.balance import attention_work, balanced_parts, contiguous_parts, imbalance
from model.config import load_config
from model.data import TrafficGenerator

WORLDS = (2, 4, 8)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "large"
    num_batches = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    config = load_config(name)
    if config.history is None:
        raise SystemExit(f"config {name} has no history: nothing to balance")
    traffic = TrafficGenerator(config)
    batches = [traffic.batch(index) for index in range(num_batches)]
    first = batches[0]
    history = first.history_offsets.diff()
    print(
        f"config {name}: {first.num_requests} requests, {first.num_candidates} candidates, histories "
        f"median {int(history.median())} max {int(history.max())} (cap {config.history.max_len}); "
        "work = (history + candidates)^2; imbalance = max part / mean part"
    )
    # split -> world -> [(work imbalance, candidates imbalance)] per batch
    rows: dict[str, dict[int, list[tuple[float, float]]]] = {"contiguous": {}, "balanced": {}}
    seconds = []
    for batch in batches:
        work = attention_work(batch)
        candidates = batch.candidate_offsets.diff()
        for world in WORLDS:
            start = time.perf_counter()
            balanced = balanced_parts(work, world)
            seconds.append(time.perf_counter() - start)
            for split, parts in (
                ("contiguous", contiguous_parts(batch.num_requests, world)),
                ("balanced", balanced),
            ):
                rows[split].setdefault(world, []).append(
                    (imbalance(work, parts), imbalance(candidates, parts))
                )

    mean, worst = f"mean of {num_batches}", f"worst of {num_batches}"
    print(f"\n{'W':>3} {'split':<11} | {'batch 0':^15} | {mean:^15} | {worst:^15}")
    print(
        f"{'':>3} {'':<11} | {'work':>7} {'cands':>7} | {'work':>7} {'cands':>7} | {'work':>7} {'cands':>7}"
    )
    for world in WORLDS:
        for split in ("contiguous", "balanced"):
            values = rows[split][world]
            work_i, cand_i = [v[0] for v in values], [v[1] for v in values]
            print(
                f"{world:>3} {split:<11} | {work_i[0]:7.3f} {cand_i[0]:7.3f} | "
                f"{statistics.mean(work_i):7.3f} {statistics.mean(cand_i):7.3f} | "
                f"{max(work_i):7.3f} {max(cand_i):7.3f}"
            )
    print(f"\nbalanced_parts: {1e3 * statistics.median(seconds):.2f} ms median per call on the host")
    big = attention_work(traffic.batch(0, num_requests=16384))
    start = time.perf_counter()
    parts = balanced_parts(big, 8)
    elapsed = time.perf_counter() - start
    print(
        f"16384 requests, W = 8: {1e3 * elapsed:.1f} ms, work imbalance {imbalance(big, parts):.4f} "
        f"(contiguous {imbalance(big, contiguous_parts(16384, 8)):.4f})"
    )


if __name__ == "__main__":
    main()
