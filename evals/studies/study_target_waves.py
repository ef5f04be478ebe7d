"""Where target attention's forward at 15 requests x 70 candidates x 32 seeds loses against the
same histories with more candidates: the same batch with its requests reordered, with whole
128-row blocks per request, with equal histories, and with eight times the candidates. Each
variant is the default launcher with bounds, replayed from a CUDA graph (no host in the time).

    python3 -m evals.studies.study_target_waves
"""

from __future__ import annotations

from functools import partial

import torch

from evals.bench_attention import graphed
from evals.studies.compare_attention import _median_ms
from kernels import attention
from search_space import get_problem
from search_space.problem import Shape

SHAPE = "r15-c70-s32-h2000-softmax"


def main() -> None:
    device = torch.device("cuda")
    problem = get_problem("target_attention")
    base = next(s for s in problem.timing_shapes if s.name == SHAPE)
    kv_offsets = problem.make_inputs(base, 0, device).args[3]
    history = (kv_offsets[1:] - kv_offsets[:-1]).tolist()
    mean = round(sum(history) / len(history))
    cands = base.params["cands_per_request"]
    variants = {
        f"the timing shape's histories, {cands} candidates": (history, cands),
        "same, 64 candidates (whole 128-row blocks)": (history, 64),
        "same, longest request first": (sorted(history, reverse=True), cands),
        "same, shortest request first": (sorted(history), cands),
        f"every history {mean}, {cands} candidates": ([mean] * len(history), cands),
        f"every history {mean}, 64 candidates": ([mean] * len(history), 64),
        f"the timing shape's histories, {8 * cands} candidates": (history, 8 * cands),
    }
    print("| variant | fwd ms | TFLOP/s |")
    print("|---|---|---|")
    params = {k: v for k, v in base.params.items() if k != "num_requests"}  # lengths listed instead
    for name, (lengths, count) in variants.items():
        shape = Shape(
            name=name,
            dtype=base.dtype,
            params={**params, "lengths": lengths, "cands": [count] * len(lengths)},
        )
        inputs = problem.make_inputs(shape, 1, device)
        bounds = {"max_candidates": count, "max_history": max(lengths)}
        replay, _ = graphed(partial(attention.target_attention_forward, *inputs.args, **bounds))
        ms = _median_ms(replay, device, 100)
        print(f"| {name} | {ms:.3f} | {problem.flops(shape) / (ms * 1e-3) / 1e12:.0f} |", flush=True)


if __name__ == "__main__":
    main()
