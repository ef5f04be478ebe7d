"""Serving the GEM-class model: a batch of requests scored in one pass, the top ads of each
request, and the latency benchmark of the request-oriented path against the naive one.

The ranking score of a candidate is the product of its task probabilities (pCTR x pCVR, the
probability of a conversion). The top-k of a request comes from its candidates padded into a
row (`kernels.ops.jagged_to_padded_dense`, padding -inf); a request with fewer than k
candidates has index -1 in the slots it cannot fill.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.ops import jagged_to_padded_dense
from model.config import ModelConfig
from model.data import RequestBatch, TrafficGenerator
from model.gem import GEMModel

# The naive path copies each request's history once per candidate; above this many history
# tokens a copy batch is not built (it would take minutes, or the GPU's memory).
NAIVE_TOKEN_BUDGET = 4_000_000


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on a GPU (as serving runs), nothing on a CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.inference_mode()
def score(model: GEMModel, batch: RequestBatch, *, naive: bool = False) -> torch.Tensor:
    """Each candidate's probability per task [B, tasks], in eval mode."""
    model.eval()
    device = batch.dense.device
    with autocast_for(device):
        output = model.naive_forward(batch) if naive else model(batch)
    return torch.sigmoid(output.logits.float())


def ranking_score(probabilities_BT: torch.Tensor) -> torch.Tensor:
    """The product of the task probabilities [B]."""
    return probabilities_BT.prod(dim=1)


def top_k_per_request(
    scores_B: torch.Tensor, candidate_offsets: torch.Tensor, k: int, *, max_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [R, k], candidate rows [R, k]) of each request's k best candidates, best first;
    -inf and -1 where a request has fewer than k. `max_candidates` bounds a request's
    candidates (a static bound: the call does not read it from the device)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    width = max(max_candidates, k)
    padded = jagged_to_padded_dense(
        scores_B.float().unsqueeze(1), candidate_offsets, max_len=width, padding_value=-math.inf
    ).squeeze(2)
    values, slots = padded.topk(k, dim=1)
    rows = candidate_offsets[:-1].unsqueeze(1) + slots
    return values, torch.where(torch.isinf(values), torch.full_like(rows, -1), rows)


def serve(
    model: GEMModel, batch: RequestBatch, k: int, *, naive: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k ads of every request of `batch`: (ranking scores [R, k], candidate rows [R, k])."""
    probabilities = score(model, batch, naive=naive)
    return top_k_per_request(
        ranking_score(probabilities), batch.candidate_offsets, k, max_candidates=batch.max_candidates
    )


def _serve_copies(
    model: GEMModel, copies: RequestBatch, pick: torch.Tensor, batch: RequestBatch, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive path's top-k: every copy scored, each candidate's own score picked."""
    probabilities = score(model, copies)[pick]
    return top_k_per_request(
        ranking_score(probabilities), batch.candidate_offsets, k, max_candidates=batch.max_candidates
    )


def _serve_graphed(graphed, batch: RequestBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """serve() with the scores from a replay of the batch's CUDA graph."""
    return top_k_per_request(
        ranking_score(graphed(batch)), batch.candidate_offsets, k, max_candidates=batch.max_candidates
    )


@dataclass
class LatencyRow:
    path: str  # "request", "graph" (request, in CUDA graphs) or "naive"
    candidates_per_request: int
    history_length: int
    requests: int
    p50_ms: float | None = None
    p99_ms: float | None = None
    candidates_per_s: float | None = None
    skipped: str | None = None  # why the row was not measured


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds `fn` takes, its device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _time(
    prepare: Callable[[RequestBatch], Callable[[], object]],
    batches: list[RequestBatch],
    device: torch.device,
    warmup: int,
) -> list[float]:
    """Seconds of a call on each of `batches` (made on the device before the first call) but the
    first `warmup`, which run untimed; each call made by `prepare(batch)` before its clock starts."""
    times = []
    for i, batch in enumerate(batches):
        call = prepare(batch)
        if i < warmup:
            call()
        else:
            times.append(timed(call, device))
    return times


def _serve_call(
    path: str, model: GEMModel, graphed, k: int, with_all_candidates: bool, batch: RequestBatch
) -> Callable[[], object]:
    """One call of `path` on `batch`, with what it needs before the clock starts (the naive path's
    copies of its requests: as large as the batch times its candidates, so made call by call)."""
    if path == "request":
        return functools.partial(serve, model, batch, k)
    if path == "graph":  # the first of the warm-up calls captures
        return functools.partial(_serve_graphed, graphed, batch, k)
    # The naive service gets each candidate's copy of its request as its input.
    per_candidate, pick = batch.per_candidate_requests(with_all_candidates=with_all_candidates)
    return functools.partial(_serve_copies, model, per_candidate, pick, batch, k)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (p99 of fewer than 100 values is their maximum)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def serve_bench(
    config: ModelConfig,
    device: torch.device | str,
    *,
    candidates: tuple[int, ...] = (64, 256, 1024, 4096),
    history_lengths: tuple[int, ...] | None = None,
    requests: int = 1,
    k: int = 10,
    repeats: int = 100,
    warmup: int = 3,
    naive: bool = True,
    graphs: bool = False,
    model: GEMModel | None = None,
    naive_token_budget: int = NAIVE_TOKEN_BUDGET,
) -> list[LatencyRow]:
    """Latency of serving `requests` requests of each candidate count and history length
    (default: the config's median and max), on the request-oriented path, (graphs, on a GPU)
    the same captured in CUDA graphs (model.graphed: the batch padded to its capacity, then one
    replay) and (naive) the path that repeats the user's work for every candidate: scores and
    top-k, end to end. Each call serves a batch of its own, a variant of the row's
    (TrafficGenerator.variant: its sizes, new ids and values), so that no implementation's memo
    of earlier answers pays and no kernel compiles in a timed call."""
    from model.graphed import GraphedScorer

    device = torch.device(device)
    if graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs serve on a GPU, not on {device}")
    if model is None:
        torch.manual_seed(config.train.seed)
        model = GEMModel(config, device=device)
    graphed = GraphedScorer(model) if graphs else None
    paths = ("request",) + ("graph",) * graphs + ("naive",) * naive
    h = config.history
    if history_lengths is None:
        history_lengths = (h.median_len, h.max_len) if h is not None else (0,)
    traffic = TrafficGenerator(config, seed=config.train.seed)
    gen = torch.Generator().manual_seed(config.train.seed)
    rows: list[LatencyRow] = []
    for length in history_lengths:
        for count in candidates:
            batch = traffic.batch(
                0,
                num_requests=requests,
                candidates_per_request=count,
                exact_candidates=True,
                history_length=length if h is not None else None,
            )
            targets = h is not None and h.candidates_as_targets
            for path in paths:
                row = LatencyRow(path, count, length, requests)
                copies = requests * count * (count if targets else 1)
                if targets and count > h.max_targets:
                    row.skipped = f"{count} candidates exceed history.max_targets {h.max_targets}"
                elif path == "naive" and copies * max(length, 1) > naive_token_budget:
                    row.skipped = (
                        f"{copies * length:,} history tokens in the copies (budget {naive_token_budget:,})"
                    )
                if row.skipped:
                    rows.append(row)
                    continue
                # The graph path's first call captures: never inside the clock.
                untimed = max(warmup, 1) if path == "graph" else warmup
                batches = [traffic.variant_on(batch, gen, device) for _ in range(untimed + repeats)]
                prepare = functools.partial(_serve_call, path, model, graphed, k, targets)
                times = _time(prepare, batches, device, untimed)
                del batches
                row.p50_ms, row.p99_ms = 1e3 * percentile(times, 50), 1e3 * percentile(times, 99)
                row.candidates_per_s = requests * count / percentile(times, 50)
                rows.append(row)
    return rows


def sublinearity(rows: list[LatencyRow], small: int = 256, large: int = 4096) -> dict[int, float]:
    """Per history length, the request path's p50 at `large` candidates over its p50 at `small`
    (the target: under 3 for 4096 over 256, the cost growing clearly sublinearly)."""
    out = {}
    by = {(r.history_length, r.candidates_per_request): r for r in rows if r.path == "request" and r.p50_ms}
    for (length, count), row in by.items():
        if count == large and (length, small) in by:
            out[length] = row.p50_ms / by[(length, small)].p50_ms
    return out
