"""`recforge model`: train, serve and profile the GEM-class model on the kernel library."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Annotated

import typer

model_app = typer.Typer(help="Train, serve and profile the GEM-class model.", no_args_is_help=True)

ConfigOption = Annotated[
    str, typer.Option("--config", help="model config TOML file, or a preset: tiny, small, large")
]
DeviceOption = Annotated[
    str | None, typer.Option(help="cuda, cuda:1, cpu (default: cuda where there is one)")
]
LibraryOption = Annotated[
    Path | None, typer.Option(help="kernel library to dispatch through (default: the installed one)")
]
JsonOption = Annotated[Path | None, typer.Option("--json", help="also write the results here as JSON")]
ReferenceOption = Annotated[
    bool,
    typer.Option("--reference-ops", help="run every op's plain PyTorch reference, not the library's kernels"),
]


def _ops(reference_ops: bool):
    """Dispatch as usual, or (reference_ops) to every op's reference."""
    from kernels import DISPATCHER

    return DISPATCHER.references_only() if reference_ops else contextlib.nullcontext()


def _setup(config: str, device: str | None, library: Path | None):
    """(the model config, the device), with dispatch pointed at `library`; a clear error for a
    bad config or device."""
    import torch

    from agent.cli import fail
    from model.config import load_config

    try:
        cfg = load_config(config)
    except ValueError as exc:
        raise fail(str(exc)) from None
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise fail(f"bad --device {name!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise fail(f"--device {name}: no CUDA GPU here")
    if library is not None:
        from kernels import DISPATCHER

        if not library.is_dir():
            raise fail(f"no kernel library at {library}")
        DISPATCHER.use_library(library)
    return cfg, dev


def _write_json(path: Path | None, data: object) -> None:
    """`data` at `path`, whole or not at all (renamed into place: a run killed while it writes
    leaves the last file)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(data, indent=2, default=str) + "\n")
        partial.replace(path)


@model_app.command("train")
def model_train(
    ctx: typer.Context,
    config: ConfigOption = "tiny",
    steps: Annotated[
        int | None, typer.Option(min=1, help="train to this step (default: the config's)")
    ] = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="checkpoint file (default: .recforge/model/<config file stem>.pt)")
    ] = None,
    resume: Annotated[bool, typer.Option(help="continue from the checkpoint if it exists")] = False,
    save: Annotated[
        bool,
        typer.Option(
            help="write the checkpoint (every checkpoint_every steps and at the end); "
            "--no-save for a benchmark run"
        ),
    ] = True,
    compile: Annotated[
        bool | None, typer.Option(help="torch.compile the model (default: the config's)")
    ] = None,
    embedding_update: Annotated[
        str | None,
        typer.Option(help="fused (the tables stepped in their backward) or unfused (default: the config's)"),
    ] = None,
    log_every: Annotated[
        int, typer.Option(min=1, help="log the loss and the window's rate every this many steps")
    ] = 10,
    device: DeviceOption = None,
    library: LibraryOption = None,
    reference_ops: ReferenceOption = False,
    json_out: JsonOption = None,
    nproc: Annotated[
        int,
        typer.Option(
            min=1,
            help="processes to train on (one GPU each), data-parallel with the tables sharded "
            "over them, started through torchrun (under a torchrun of your own: its ranks)",
        ),
    ] = 1,
    balance: Annotated[
        bool,
        typer.Option(help="with --nproc: split each batch by attention work, else in consecutive blocks"),
    ] = True,
) -> None:
    """Train with AdamW (dense) and row-wise Adagrad (embeddings, fused into their backward
    unless told otherwise), bf16 autocast on a GPU: the loss, held-out AUC, examples per second
    and MFU as it goes, a checkpoint to resume from (with --nproc, a file per rank)."""
    if "LOCAL_RANK" in os.environ:  # a rank that torchrun started (here, or by hand)
        nproc = int(os.environ["WORLD_SIZE"])
    elif nproc > 1:  # this process starts the ranks, and waits for them
        _check_ranks(*_setup(config, device, library), nproc, embedding_update)
        raise typer.Exit(_torchrun(nproc, ["model", "train", *_given_options(ctx, leave_out="nproc")]))
    cfg, dev = _setup(config, device, library)
    with _ranks(nproc, dev, balance) as (parallel, dev):
        if parallel is not None and parallel.rank != 0:  # the first rank speaks for the run
            from agent.cli import console, err

            console.quiet = err.quiet = True
        _train(cfg, dev, parallel, config=config, steps=steps, checkpoint=checkpoint, resume=resume,
               save=save, compile=compile, embedding_update=embedding_update, reference_ops=reference_ops,
               json_out=json_out, log_every=log_every)  # fmt: skip


def _check_ranks(cfg, dev, nproc: int, embedding_update: str | None) -> None:
    """Refuse here, before any rank starts, a data-parallel run that cannot be made."""
    import torch

    from agent.cli import fail
    from model.sharding import FUSED_ONLY

    if (embedding_update or cfg.train.embedding_update) != "fused":
        raise fail(f"--nproc {nproc}: {FUSED_ONLY}: pass --embedding-update fused")
    if cfg.data.requests_per_batch < nproc:
        raise fail(
            f"--nproc {nproc}: a batch of {cfg.data.requests_per_batch} requests cannot give each rank one"
        )
    if dev.type == "cuda":
        if dev.index is not None:
            raise fail(f"--nproc {nproc}: each rank takes a GPU of its own; pass --device cuda, not {dev}")
        if torch.cuda.device_count() < nproc:
            raise fail(f"--nproc {nproc}: this host has {torch.cuda.device_count()} GPU(s)")


def _given_options(ctx: typer.Context, *, leave_out: str) -> list[str]:
    """The options given on this command line (not their defaults), as a command line again,
    but `leave_out`."""
    args: list[str] = []
    for param in ctx.command.params:
        if param.param_type_name != "option" or param.name in (leave_out, None):
            continue
        if ctx.get_parameter_source(param.name).name == "DEFAULT":
            continue
        value = ctx.params[param.name]
        if param.is_flag:
            args += (param.opts if value else param.secondary_opts)[:1]
        elif value is not None:
            args += [param.opts[0], str(value)]
    return args


def _torchrun(nproc: int, args: list[str]) -> int:
    """Run `recforge ARGS` as `nproc` ranks on this host through torchrun; their exit code."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "agent", *args]  # fmt: skip
    return subprocess.call(cmd)


@contextlib.contextmanager
def _ranks(nproc: int, dev, balance: bool):
    """(this rank's DataParallel, its device) within the run's process group (NCCL on GPUs,
    gloo on CPUs), joined as the rank torchrun made and left at the end; (None, dev) for a run
    of one process."""
    if nproc == 1:
        yield None, dev
        return
    import torch
    import torch.distributed as dist

    from agent.cli import fail
    from model.training import DataParallel

    if dev.type == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        if local >= torch.cuda.device_count():
            ranks_here = os.environ.get("LOCAL_WORLD_SIZE", nproc)
            raise fail(f"{ranks_here} ranks on this host, but it has {torch.cuda.device_count()} GPU(s)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")
    try:
        yield DataParallel.of_group(balance=balance), dev
        dist.barrier()  # every rank done before any leaves
    finally:
        dist.destroy_process_group()


def _train(cfg, dev, parallel, *, config, steps, checkpoint, resume, save, compile, embedding_update,
           reference_ops, json_out, log_every) -> None:  # fmt: skip
    """`recforge model train` in this process (one rank of a data-parallel run, or the run)."""
    from dataclasses import asdict, replace

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agent.cli import _table, console, fail
    from model.data import TrafficGenerator
    from model.flops import BatchSizes, by_component, forward_flops, training_flops
    from model.training import Trainer

    if compile is not None:
        cfg = replace(cfg, train=replace(cfg.train, compile=compile))
    if embedding_update is not None:
        try:
            cfg = replace(cfg, train=replace(cfg.train, embedding_update=embedding_update))
        except ValueError as exc:
            raise fail(f"--embedding-update: {exc}") from None
    # Named after the config file (or preset) trained: two configs never share a checkpoint.
    checkpoint = checkpoint or Path(".recforge") / "model" / f"{Path(config).stem}.pt"
    try:
        if resume and Trainer.checkpoint_exists(checkpoint, parallel):
            trainer = Trainer.resume(checkpoint, dev, config=cfg, parallel=parallel)
            console.print(f"resumed {checkpoint} at step {trainer.step}")
        else:
            trainer = Trainer(cfg, dev, parallel=parallel)
    except ValueError as exc:
        raise fail(str(exc)) from None
    cfg = trainer.config
    end = steps or cfg.train.steps

    history = cfg.history
    sizes = BatchSizes.of(
        TrafficGenerator(cfg, seed=cfg.train.seed).batch(0),
        candidates_as_targets=history is not None and history.candidates_as_targets,
    )
    per_step = by_component(training_flops(forward_flops(cfg, sizes)))
    total = sum(per_step.values())
    table = _table(
        "component", "GFLOP per step", "share", title=f"{cfg.name}: model FLOPs of a training step"
    )
    for name, value in sorted(per_step.items(), key=lambda kv: -kv[1]):
        table.add_row(name, f"{value / 1e9:,.2f}", f"{value / total:.1%}")
    console.print(table)
    # The tables count whether a parameter (unfused) or a buffer their backward steps (fused),
    # whole or sharded.
    params = sum(p.numel() for p in trainer.model.dense_parameters()) + sum(
        t.num_rows * t.dim for t in cfg.tables
    )
    where = str(dev)
    if parallel is not None:
        where = f"{parallel.world} ranks ({dev.type}), data-parallel"
        for line in trainer.model.sparse.embeddings.plan.describe(cfg.tables):
            console.print(f"  table {line}")
    console.print(
        f"{params / 1e6:,.1f}M parameters on {where}; {sizes.requests} requests, "
        f"{sizes.candidates} candidates "
        f"and {sizes.history_tokens:,} history tokens per batch; peak "
        + ("unknown (no MFU)" if trainer.peak is None else f"{trainer.peak / 1e12:,.0f} TFLOP/s")
    )

    def dump(history, complete: bool = False) -> None:
        if json_out is None or (parallel is not None and parallel.rank != 0):
            return
        _write_json(
            json_out,
            {
                "config": cfg.name,
                "device": str(dev),
                "ranks": 1 if parallel is None else parallel.world,
                "complete": complete,  # false while training, and where the run was cut short
                "flops_per_step": per_step,
                "steps": [asdict(s) for s in history.steps],
                "evals": [asdict(e) for e in history.evals],
            },
        )

    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "loss {task.fields[loss]}  auc {task.fields[auc]}  {task.fields[rate]}  mfu {task.fields[mfu]}"
        ),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(
            "train", total=end, completed=trainer.step, loss="-", auc="-", rate="-", mfu="-"
        )

        def on_step(log) -> None:
            dump(trainer.history)  # what a run cut short has logged is kept
            progress.update(
                task,
                completed=log.step,
                loss=f"{log.loss:.4f}",
                rate=f"{log.examples_per_s:,.0f} ex/s",
                mfu="-" if log.mfu is None else f"{log.mfu:.1%}",
            )

        def on_eval(log) -> None:
            aucs = "  ".join(f"{t} {v:.4f}" for t, v in log.auc.items())
            progress.update(task, auc=f"{next(iter(log.auc.values())):.4f}")
            progress.console.print(f"step {log.step}: held-out AUC {aucs}")

        try:
            with _ops(reference_ops):
                result = trainer.fit(
                    end,
                    checkpoint=checkpoint if save else None,
                    on_step=on_step,
                    on_eval=on_eval,
                    log_every=log_every,
                )
        except FloatingPointError as exc:
            raise fail(str(exc)) from None
    last = result.steps[-1] if result.steps else None
    final = result.evals[-1] if result.evals else None
    if last is not None and final is not None:
        saved = checkpoint if parallel is None else parallel.checkpoint(checkpoint, rank="*")
        console.print(
            f"step {last.step}: loss {last.loss:.4f}, AUC "
            + ", ".join(f"{t} {v:.4f}" for t, v in final.auc.items())
            + f", {last.examples_per_s:,.0f} examples/s"
            + ("" if last.mfu is None else f", MFU {last.mfu:.1%} (target: 40% or more)")
            + (f"; checkpoint {saved}" if save else "; no checkpoint written (--no-save)")
        )
    dump(result, complete=True)


def _counts(text: str, option: str, least: int) -> tuple[int, ...]:
    from agent.cli import fail

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise fail(f"{option} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < least:
        raise fail(f"{option} takes comma-separated integers >= {least}, got {text!r}")
    return values


@model_app.command("serve-bench")
def model_serve_bench(
    config: ConfigOption = "tiny",
    candidates: Annotated[
        str, typer.Option(help="candidates per request, comma-separated")
    ] = "64,256,1024,4096",
    history: Annotated[
        str | None,
        typer.Option(help="history lengths, comma-separated (default: the config's median and max)"),
    ] = None,
    requests: Annotated[int, typer.Option(min=1, help="requests per served batch")] = 1,
    top_k: Annotated[int, typer.Option(min=1, help="ads returned per request")] = 10,
    repeats: Annotated[int, typer.Option(min=1, help="timed batches per row (p99 needs 100)")] = 100,
    naive: Annotated[
        bool, typer.Option(help="also time the path that repeats the user's work per candidate")
    ] = True,
    graphs: Annotated[
        bool | None,
        typer.Option(help="also time the request path captured in CUDA graphs (default: on a GPU)"),
    ] = None,
    device: DeviceOption = None,
    library: LibraryOption = None,
    reference_ops: ReferenceOption = False,
    json_out: JsonOption = None,
) -> None:
    """Serving latency (p50, p99) and candidates per second against candidates per request and
    history length, on the request-oriented path beside the naive one (and, on a GPU, beside
    itself in CUDA graphs)."""
    from dataclasses import asdict

    from agent.cli import _table, console, fail
    from model.serving import serve_bench, sublinearity

    cfg, dev = _setup(config, device, library)
    counts = _counts(candidates, "--candidates", 1)
    lengths = _counts(history, "--history", 0) if history is not None else None
    if lengths is not None and cfg.history is None:
        raise fail("--history given, but the config has no history")
    if cfg.history is not None and lengths is not None and max(lengths) > cfg.history.max_len:
        raise fail(f"--history {max(lengths)} exceeds the config's history max_len {cfg.history.max_len}")
    if graphs and reference_ops:
        raise fail(
            "--graphs with --reference-ops: the reference ops copy to the host, which a CUDA graph cannot"
        )
    try:
        with _ops(reference_ops):
            rows = serve_bench(
                cfg,
                dev,
                candidates=counts,
                history_lengths=lengths,
                requests=requests,
                k=top_k,
                repeats=repeats,
                naive=naive,
                graphs=dev.type == "cuda" and not reference_ops if graphs is None else graphs,
            )
    except ValueError as exc:
        raise fail(str(exc)) from None
    table = _table(
        "history", "candidates", "path", "p50 ms", "p99 ms", "candidates/s", "over request",
        title=f"{cfg.name} serving on {dev}: {requests} request(s) per batch, top {top_k}",
    )  # fmt: skip
    request_p50 = {
        (r.history_length, r.candidates_per_request): r.p50_ms for r in rows if r.path == "request"
    }
    for r in rows:
        if r.skipped:
            table.add_row(
                str(r.history_length), str(r.candidates_per_request), r.path, "-", "-", "-", r.skipped
            )
            continue
        base = request_p50.get((r.history_length, r.candidates_per_request))
        speedup = f"{r.p50_ms / base:.2f}x" if r.path != "request" and base else ""
        timings = (f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}", f"{r.candidates_per_s:,.0f}")
        table.add_row(str(r.history_length), str(r.candidates_per_request), r.path, *timings, speedup)
    console.print(table)
    growth = sublinearity(rows)
    for length, ratio in growth.items():
        console.print(
            f"history {length}: 4096 candidates take {ratio:.2f}x the time of 256 "
            f"(target: under 3x, {'met' if ratio < 3 else 'not met'})"
        )
    _write_json(
        json_out,
        {"config": cfg.name, "device": str(dev), "rows": [asdict(r) for r in rows], "growth": growth},
    )


@model_app.command("profile")
def model_profile(
    graph: Annotated[str, typer.Option(help="train or serve")] = "train",
    config: ConfigOption = "tiny",
    steps: Annotated[int, typer.Option(min=1, help="profiled steps")] = 3,
    warmup: Annotated[
        int,
        typer.Option(min=0, help="untimed steps first, on the profiled steps' batches (each one at least)"),
    ] = 2,
    trace: Annotated[Path | None, typer.Option(help="also write the torch profiler's trace here")] = None,
    device: DeviceOption = None,
    library: LibraryOption = None,
    reference_ops: ReferenceOption = False,
    json_out: JsonOption = None,
) -> None:
    """Time per kernel-library op and shape bucket of a training or serving step, with each
    one's roofline fraction (where the device's peaks are known) and the rest of the step."""
    from agent.cli import _table, console, fail
    from model.profile import GRAPHS, profile_model

    if graph not in GRAPHS:
        raise fail(f"--graph must be one of {', '.join(GRAPHS)}, got {graph!r}")
    cfg, dev = _setup(config, device, library)
    with _ops(reference_ops):
        result = profile_model(cfg, graph, dev, steps=steps, warmup=warmup, trace_file=trace)
    table = _table(
        "op", "bucket", "dtype", "implementation", "calls", "ms", "share", "GFLOP", "MB", "roofline",
        title=f"{cfg.name} {graph} step on {result.device}: {result.step_ms:.3f} ms",
    )  # fmt: skip
    for r in result.rows:
        cost = (
            "-" if r.gflops is None else f"{r.gflops:.3f}",
            "-" if r.mbytes is None else f"{r.mbytes:.2f}",
            "-" if r.fraction is None else f"{r.fraction:.1%}",
        )
        implementations = ", ".join(r.implementations)
        table.add_row(
            r.op, r.bucket, r.dtype, implementations, f"{r.calls:g}", f"{r.ms:.3f}", f"{r.share:.1%}", *cost
        )
    console.print(table)
    _write_json(json_out, result.to_dict())
