"""Every public op (`kernels.ops`) of two source trees side by side, forward and forward+backward,
at the workload's shapes: short bags and sequences as well as long ones, bf16 and fp32, the
serving and the training batches of target attention.

Each tree runs in a worker process of its own (its `kernels` first on sys.path, nothing else of
recforge imported), and the driver asks them for the cases in the order A B B A, so that a drift
of the GPU's clocks or of the host over the run falls on both trees alike; each tree's figure is
the mean of its two measurements, and their spread is the noise to read a ratio against. Inputs
come from fixed seeds, the same in both workers, and each answer carries its outputs' norm so
that a tree computing something else shows up as a mismatch rather than as a speedup.

Three timings per pass: "single", the median of one call between CUDA events over a flushed L2
(host time counts where the GPU waits for it); "steady", back-to-back calls between one pair of
events divided by their number (what a training step's stream sees); and "host_us", the host's
microseconds until one call returns (launches only, the GPU idle at its start).

    git archive <commit> | tar x -C /tmp/before
    python3 evals/studies/ops_public.py --tree after=. --tree before=/tmp/before \
        [--case SUBSTRING ...] [--json rows.jsonl] [--host-profile CALLS]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLUSH_BYTES = 256 * 1024**2
HEADS, HEAD_DIM = 4, 128
DEVICE = "cuda"


# --- inputs ----------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _lengths(kind: tuple, n: int, gen: torch.Generator) -> torch.Tensor:
    """("short",): 1 to 3 ids, P .6/.25/.15; ("pl", N): power law 1..N, P(L) ~ L^-1.1;
    ("uniform", lo, hi); ("loguniform", lo, hi): Zipf-like, median sqrt(lo * hi)."""
    if kind[0] == "short":
        probs = torch.tensor([0.6, 0.25, 0.15], device=DEVICE)
        return torch.multinomial(probs, n, replacement=True, generator=gen) + 1
    if kind[0] == "pl":
        probs = torch.arange(1, kind[1] + 1, dtype=torch.float32, device=DEVICE).pow(-1.1)
        return torch.multinomial(probs / probs.sum(), n, replacement=True, generator=gen) + 1
    u = torch.rand(n, generator=gen, device=DEVICE)
    lo, hi = kind[1], kind[2]
    if kind[0] == "uniform":
        return (lo + u * (hi - lo + 1)).long().clamp(max=hi)
    return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))).long().clamp(lo, hi)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=DEVICE)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _heads(total: int, dtype: torch.dtype, gen: torch.Generator, lead: tuple = ()) -> torch.Tensor:
    return torch.randn(*lead, total, HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(dtype)


def embedding_bag_case(rows: int, dim: int, bags: int, kind: tuple, weighted: bool = False):
    def build(ops, dtype, gen):
        offsets = _offsets(_lengths(kind, bags, gen))
        nnz = int(offsets[-1])
        indices = torch.randint(0, rows, (nnz,), generator=gen, device=DEVICE)
        weight = torch.randn(rows, dim, generator=gen, device=DEVICE).to(dtype)
        psw = torch.rand(nnz, generator=gen, device=DEVICE).to(dtype) if weighted else None

        def call(leaves):
            return ops.embedding_bag(leaves[0], indices, offsets, per_sample_weights=psw)

        return call, [weight], {"ids": nnz}

    return build


# The table-batched lookup's tables (rows, dim), as its timing shapes have them
# (search_space/embedding_bags.py; this script imports no more of recforge than `kernels`).
BAG_TABLES = (
    (4_000_000, 64), (2_000_000, 128), (1_000_000, 128), (1_000_000, 32), (500_000, 256),
    (200_000, 64), (100_000, 16), (50_000, 128), (20_000, 32), (10_000, 256), (10_000, 64),
    (10_000, 16),
)  # fmt: skip


def embedding_bags_case(batch: int, features: int, pooled: int = 0):
    """Feature f looks up table f mod 12 (every table's rows in one flat buffer); the first
    `pooled` features hold power-law bags of up to 120 ids, the others one to three, with int64
    ids. The batch, feature count and tables are those of the lookup's timing shape of the same
    name; its bags are drawn otherwise (that shape's pooled features have different longest
    bags, its short ones their own longest of 1 to 3, and its fp32 shape int32 ids)."""

    def build(ops, dtype, gen):
        sizes = [rows * dim for rows, dim in BAG_TABLES]
        starts = [0, *itertools.accumulate(sizes)]
        which = [f % len(BAG_TABLES) for f in range(features)]
        dims = [BAG_TABLES[t][1] for t in which]
        weight_offsets = torch.tensor([starts[t] for t in which], device=DEVICE)
        dim_offsets = torch.tensor([0, *itertools.accumulate(dims)], device=DEVICE)
        lengths = torch.cat([_lengths(_PL120 if f < pooled else _SHORT, batch, gen) for f in range(features)])
        offsets = _offsets(lengths)
        bag_rows = torch.tensor([BAG_TABLES[t][0] for t in which], device=DEVICE).repeat_interleave(batch)
        rows = bag_rows.repeat_interleave(lengths)
        indices = (torch.rand(rows.numel(), generator=gen, device=DEVICE) * rows).long()
        weights = 0.1 * torch.randn(sum(sizes), generator=gen, device=DEVICE).to(dtype)
        bounds = {"total_dim": sum(dims), "max_dim": max(dims)}

        def call(leaves):
            return ops.embedding_bags(leaves[0], weight_offsets, dim_offsets, indices, offsets, **bounds)

        return call, [weights], {"ids": indices.numel()}

    return build


def jagged_attention_case(batch: int, kind: tuple, activation: str, targets: int = 0, bias: bool = False):
    def build(ops, dtype, gen):
        lengths = _lengths(kind, batch, gen)
        offsets = _offsets(lengths)
        total, longest = int(offsets[-1]), int(lengths.max())
        q, k, v = (_heads(total, dtype, gen) for _ in range(3))
        rel_bias = 0.1 * torch.randn(HEADS, 32, generator=gen, device=DEVICE) if bias else None
        num_targets = torch.clamp(lengths, max=targets) if targets else None

        def call(leaves):
            return ops.jagged_attention(
                *leaves[:3], offsets, max_seq_len=longest, activation=activation, causal=True,
                num_targets=num_targets, rel_bias=leaves[3] if bias else None,
            )  # fmt: skip

        leaves = [q, k, v] + ([rel_bias] if bias else [])
        return call, leaves, {"tokens": total, "longest": longest}

    return build


def gdpa_case(batch: int, kv_kind: tuple, activation: str, seeds: int = 0, q_kind: tuple | None = None):
    def build(ops, dtype, gen):
        kv_lengths = _lengths(kv_kind, batch, gen)
        kv_offsets = _offsets(kv_lengths)
        k, v = (_heads(int(kv_offsets[-1]), dtype, gen) for _ in range(2))
        if seeds:
            q, q_offsets, max_q = _heads(seeds, dtype, gen), None, None
        else:
            q_lengths = _lengths(q_kind, batch, gen)
            q_offsets = _offsets(q_lengths)
            q, max_q = _heads(int(q_offsets[-1]), dtype, gen), int(q_lengths.max())
        bounds = {"max_kv_len": int(kv_lengths.max())} | ({} if seeds else {"max_q_len": max_q})

        def call(leaves):
            return ops.gdpa(
                *leaves, q_offsets, kv_offsets, activation=activation, broadcast_q=bool(seeds), **bounds
            )

        return call, [q, k, v], {"keys": int(kv_offsets[-1])}

    return build


def target_attention_case(requests: int, candidates: tuple, seeds: int, history: tuple):
    def build(ops, dtype, gen):
        per_request = _lengths(candidates, requests, gen)
        hist = _lengths(history, requests, gen)
        kv_offsets = _offsets(hist)
        cand_to_request = torch.repeat_interleave(torch.arange(requests, device=DEVICE), per_request)
        order = torch.randperm(cand_to_request.numel(), generator=gen, device=DEVICE)
        cand_to_request = cand_to_request[order]
        q = _heads(seeds, dtype, gen, lead=(cand_to_request.numel(),))
        k, v = (_heads(int(kv_offsets[-1]), dtype, gen) for _ in range(2))
        bounds = {"max_candidates": int(per_request.max()), "max_history": int(hist.max())}

        def call(leaves):
            return ops.target_attention(*leaves, kv_offsets, cand_to_request, activation="softmax", **bounds)

        return call, [q, k, v], {"candidates": cand_to_request.numel(), "keys": int(kv_offsets[-1])}

    return build


# name -> (op, dtypes, builder). WORKLOAD.md: bags of 1 to 3 ids are most features, power law
# up to 120 the rest, D 16 to 256, tables to 1e7 rows, 64k to 300k samples; HSTU encoders of
# 256 sequences per GPU (median length about 500, up to 4096), 4 heads of 128; GDPA over 1024
# samples with key lengths 256 to 2048 and 32 to 256 seeds; target attention at serving (15
# requests x 70 candidates, or 1 x 2048) and training (256 users x 32 candidates).
_EB, _EBS, _JA, _GD, _TA = (
    embedding_bag_case,
    embedding_bags_case,
    jagged_attention_case,
    gdpa_case,
    target_attention_case,
)
_BOTH, _BF16, _FP32 = ("fp32", "bf16"), ("bf16",), ("fp32",)
_SHORT, _PL120 = ("short",), ("pl", 120)


def _u(lo: int, hi: int) -> tuple:
    return ("uniform", lo, hi)


def _lu(lo: int, hi: int) -> tuple:
    return ("loguniform", lo, hi)


CASES: dict[str, tuple[str, tuple[str, ...], object]] = {
    "eb/b64k-d128-1m-pl120": ("embedding_bag", _BOTH, _EB(10**6, 128, 65536, _PL120)),
    "eb/b256k-d64-4m-pl120-w": ("embedding_bag", _BF16, _EB(4 * 10**6, 64, 262144, _PL120, True)),
    "eb/b256k-d64-4m-short": ("embedding_bag", _BOTH, _EB(4 * 10**6, 64, 262144, _SHORT)),
    "eb/b64k-d16-100k-short": ("embedding_bag", _BF16, _EB(10**5, 16, 65536, _SHORT)),
    "eb/b300k-d128-10m-short": ("embedding_bag", _BF16, _EB(10**7, 128, 300000, _SHORT)),
    "ebs/b64k-f26-short": ("embedding_bags", _BF16, _EBS(65536, 26)),
    "ebs/b128k-f32-mixed": ("embedding_bags", _BF16, _EBS(131072, 32, pooled=4)),
    "ebs/b128k-f20-short": ("embedding_bags", _FP32, _EBS(131072, 20)),
    "ja/b256-l64to4096-silu-bias": ("jagged_attention", _BF16, _JA(256, _lu(64, 4096), "silu", bias=True)),
    "ja/b256-l64to4096-softmax-t32": ("jagged_attention", _BF16, _JA(256, _lu(64, 4096), "softmax", 32)),
    "ja/b1024-l1to64-silu-bias": ("jagged_attention", _BF16, _JA(1024, _u(1, 64), "silu", bias=True)),
    "ja/b64-l64to1024-softmax": ("jagged_attention", _FP32, _JA(64, _lu(64, 1024), "softmax")),
    "gdpa/b1024-s64-kv256to2048-gelu": ("gdpa", _BF16, _GD(1024, _u(256, 2048), "gelu", seeds=64)),
    "gdpa/b1024-q32to256-kv256to2048-silu": ("gdpa", _BF16, _GD(1024, _u(256, 2048), "silu", 0, _u(32, 256))),
    "gdpa/b1024-s32-kv1to64-gelu": ("gdpa", _BF16, _GD(1024, _u(1, 64), "gelu", seeds=32)),
    "gdpa/b128-s64-kv256to2048-gelu": ("gdpa", _FP32, _GD(128, _u(256, 2048), "gelu", seeds=64)),
    "ta/serve-r15-c70-s32-h400to2000": ("target_attention", _BOTH, _TA(15, _u(50, 90), 32, _u(400, 2000))),
    "ta/serve-r1-c2048-s32-h2000": ("target_attention", _BF16, _TA(1, _u(2048, 2048), 32, _u(2000, 2000))),
    "ta/train-r256-c32-s32-h64to4096": ("target_attention", _BF16, _TA(256, _u(32, 32), 32, _lu(64, 4096))),
    "ta/train-r256-c32-s32-h1to64": ("target_attention", _BF16, _TA(256, _u(32, 32), 32, _u(1, 64))),
}


# --- timing (in the worker) ------------------------------------------------------------------
def _single_ms(fn, flush: torch.Tensor, reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _steady_ms(fn, calls: int = 20, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _host_us(fn, reps: int = 15) -> float:
    """Host microseconds one call takes to return (the GPU idle at its start)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _host_profile(fn, calls: int) -> list[str]:
    """The host's functions by their own time over `calls` calls (cProfile, so slower than the
    calls alone): the top 25, microseconds a call each, with their calls a call."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])[:25]
    return [
        f"{tottime * 1e6 / calls:9.1f} us {primitive / calls:6.1f}x  {Path(file).name}:{line} {name}"
        for (file, line, name), (primitive, _, tottime, _, _) in rows
    ]


def measure(ops, case: str, dtype: str, host_profile: int = 0) -> dict:
    _, _, build = CASES[case]
    call, leaves, info = build(ops, DTYPES[dtype], _gen(1234))
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=DEVICE)
    out = call(leaves)
    norm = float(out.double().norm())
    grad = torch.randn(out.shape, generator=_gen(99), device=DEVICE).to(out.dtype)
    params = [t.detach().requires_grad_(True) for t in leaves]

    def forward():
        call(leaves)

    def forward_backward():
        for p in params:
            p.grad = None
        call(params).backward(grad)

    forward_backward()
    grad_norm = float(sum(p.grad.double().norm() ** 2 for p in params) ** 0.5)
    result = {"norm": norm, "grad_norm": grad_norm} | info
    for name, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        result[f"{name} single"] = _single_ms(fn, flush)
        result[f"{name} steady"] = _steady_ms(fn)
        result[f"{name} host_us"] = _host_us(fn)
    if host_profile:
        result["host_profile"] = _host_profile(forward_backward, host_profile)
    return result


def serve() -> int:
    """Worker: one JSON request per stdin line ({"case", "dtype"}), one JSON answer per line."""
    from kernels import ops

    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = measure(ops, request["case"], request["dtype"], request.get("host_profile", 0))
        except Exception as exc:  # out of memory, an unsupported case: the row's note
            answer = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        torch.cuda.empty_cache()
        print(json.dumps(answer), flush=True)
    return 0


# --- driver ----------------------------------------------------------------------------------
class Worker:
    def __init__(self, label: str, tree: Path) -> None:
        self.label, self.tree = label, tree
        self.proc: subprocess.Popen | None = None

    def ask(self, case: str, dtype: str, host_profile: int = 0) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            path = os.pathsep.join([str(self.tree), os.environ.get("PYTHONPATH", "")])
            env = dict(os.environ, PYTHONPATH=path)
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--serve"], cwd=self.tree, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
        self.proc.stdin.write(json.dumps({"case": case, "dtype": dtype, "host_profile": host_profile}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc = None
            return {"error": "the worker died"}
        return json.loads(line)


def _combine(answers: list[dict], key: str) -> tuple[float, float] | None:
    values = [a[key] for a in answers if key in a]
    if len(values) != len(answers):
        return None
    return statistics.fmean(values), (max(values) - min(values)) / statistics.fmean(values)


def drive(
    trees: list[tuple[str, Path]], only: list[str], json_path: str | None, host_profile: int = 0
) -> int:
    workers = [Worker(label, path) for label, path in trees]
    a, b = workers
    print(f"{a.label} vs {b.label}: ratio = {b.label} / {a.label} (above 1: {a.label} faster;"
          " host_us in microseconds, the rest in ms); noise = the larger within-tree spread of the"
          " two measurements", flush=True)  # fmt: skip
    head = f"{'case':38} {'dtype':5} {'pass':7} {'timing':7} {a.label:>10} {b.label:>10}"
    head += f" {'ratio':>6} {'noise':>6}"
    table = [head]
    print(head, flush=True)
    for case, (op, dtypes, _) in CASES.items():
        if only and not any(s in case for s in only):
            continue
        for dtype in dtypes:
            started = time.perf_counter()
            answers = {w.label: [] for w in workers}
            for w in (a, b, b, a):
                answers[w.label].append(w.ask(case, dtype, host_profile))
            row = {"case": case, "op": op, "dtype": dtype, "seconds": round(time.perf_counter() - started, 1)}
            row |= {w.label: answers[w.label] for w in workers}
            errors = [x["error"] for w in workers for x in answers[w.label] if "error" in x]
            if errors:
                line = f"{case:38} {dtype:5} error: {errors[0]}"
                print(line, flush=True)
                table.append(line)
            else:
                first = answers[a.label][0]
                for other in answers[a.label][1:] + answers[b.label]:
                    for key in ("norm", "grad_norm"):
                        if abs(other[key] - first[key]) > 2e-3 * abs(first[key]):
                            row.setdefault("mismatch", []).append(key)
                for key in [f"{p} {t}" for p in ("fwd", "fwd+bwd") for t in ("single", "steady", "host_us")]:
                    (ma, na), (mb, nb) = _combine(answers[a.label], key), _combine(answers[b.label], key)
                    pass_name, timing = key.split()
                    line = f"{case:38} {dtype:5} {pass_name:7} {timing:7} {ma:10.3f} {mb:10.3f}"
                    line += f" {mb / ma:6.2f} {max(na, nb):6.2f}"
                    if row.get("mismatch"):
                        line += "  outputs differ: " + ",".join(row["mismatch"])
                    print(line, flush=True)
                    table.append(line)
                for w in workers if host_profile else ():
                    print(f"  {w.label}'s host, forward+backward ({host_profile} calls under cProfile):")
                    for entry in answers[w.label][0]["host_profile"]:
                        print("    " + entry, flush=True)
            if json_path:
                with open(json_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print("\n" + "\n".join(table))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH, twice")
    parser.add_argument("--case", action="append", default=[], help="only cases containing this")
    parser.add_argument("--json", default=None, help="append one row per case and dtype here")
    parser.add_argument(
        "--host-profile", type=int, default=0, metavar="CALLS",
        help="also profile the host's functions over CALLS forward+backward calls (cProfile), per tree",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.serve:
        return serve()
    if len(args.tree) != 2 or not all("=" in t for t in args.tree):
        parser.error("give --tree LABEL=PATH twice")
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree]
    for label, path in trees:
        if not (path / "kernels" / "ops.py").is_file():
            parser.error(f"--tree {label}={path}: no kernels/ops.py there")
    return drive(trees, args.case, args.json, args.host_profile)


if __name__ == "__main__":
    raise SystemExit(main())
