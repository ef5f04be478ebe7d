"""The `recforge` command line."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Table
from rich.text import Text

from agent.model_cli import model_app
from sandbox.result import EvalResult, ratio

if TYPE_CHECKING:
    from agent.state import CampaignProgress

app = typer.Typer(
    help="recforge: agentic Triton kernel optimization for ads ranking models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
campaign_app = typer.Typer(help="Run, resume and inspect optimization campaigns.", no_args_is_help=True)
sandbox_app = typer.Typer(help="Evaluate a candidate kernel in the sandbox.", no_args_is_help=True)
library_app = typer.Typer(help="The library of accepted kernels.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
llm_app = typer.Typer(help="The LLM endpoint a campaign proposes with.", no_args_is_help=True)
review_app = typer.Typer(
    help="Kernel changes for review: each accepted kernel as a git branch.", no_args_is_help=True
)
app.add_typer(campaign_app, name="campaign")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(library_app, name="library")
app.add_typer(bench_app, name="bench")
app.add_typer(review_app, name="review")
app.add_typer(llm_app, name="llm")
app.add_typer(model_app, name="model")

console = Console()


def _table(*columns: str, **kwargs) -> Table:
    """A table whose every column folds rather than cutting: ids stay whole at 80 columns."""
    table = Table(**kwargs)
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


err = Console(stderr=True, soft_wrap=True)

HomeOption = Annotated[
    Path | None, typer.Option("--home", help="campaign home (default $RECFORGE_HOME or ./.recforge)")
]


def _interpret_without_gpu() -> None:
    """Without a GPU, run Triton kernels in the interpreter; must precede triton's import."""
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}")  # the message's brackets ([llm]) are its own
    return typer.Exit(code)


def local_backend(**kwargs):
    """sandbox.local.LocalBackend(**kwargs), or the CLI's one-line error where its sandbox cannot
    run on this host."""
    from sandbox.isolation import IsolationUnavailable
    from sandbox.local import LocalBackend

    try:
        return LocalBackend(**kwargs)
    except IsolationUnavailable as exc:
        raise fail(str(exc)) from None


def _amount(done: float, limit: float, unit: str = "", digits: int = 0) -> str:
    left = max(0.0, limit - done)
    return f"{done:.{digits}f} of {limit:.{digits}f}{unit} ({left:.{digits}f}{unit} left)"


class _CampaignProgress(Progress):
    """Bars for the budgets (evaluations, wall time and, where configured, GPU seconds and LLM
    tokens and money) over a line per problem: its evaluations, best speedup and last status."""

    def __init__(self, config, *, console: Console) -> None:
        self.budget = config.budget
        self.problems: dict[str, dict] = {
            p: {"evaluations": 0, "best": "", "last": ""} for p in config.problems
        }
        self.plan: str | None = None  # why the plan chose the problem it works on (a model's campaign)
        # Wall time runs on between reports: the last one reported and when it came.
        self._wall_s, self._wall_at = 0.0, time.monotonic()
        self.tasks_by_budget: dict[str, TaskID] = {}  # Progress.__init__ draws the display once, empty
        columns = (TextColumn("{task.description:<13}"), BarColumn(), TextColumn("{task.fields[amount]}"))
        super().__init__(*columns, console=console)
        limits = {
            "evaluations": ("evaluations", self.budget.max_evaluations),
            "wall": ("wall time", self.budget.max_wall_s),
            "gpu": ("GPU seconds", self.budget.max_gpu_s),
            "tokens": ("LLM tokens", self.budget.max_llm_tokens),
            "cost": ("LLM money", self.budget.max_llm_cost),
        }
        self.tasks_by_budget = {
            name: self.add_task(label, total=limit, amount="")
            for name, (label, limit) in limits.items()
            if limit is not None
        }

    def report(self, progress: CampaignProgress) -> None:
        spent = progress.spent
        self._wall_s, self._wall_at = spent.wall_s, time.monotonic()
        if progress.plan is not None:
            self.plan = progress.plan
        values = {
            "evaluations": (spent.evaluations, _amount(spent.evaluations, self.budget.max_evaluations)),
            "gpu": (spent.gpu_s, _amount(spent.gpu_s, self.budget.max_gpu_s or 0, " s", 1)),
            "tokens": (spent.llm_tokens, _amount(spent.llm_tokens, self.budget.max_llm_tokens or 0)),
            "cost": (spent.llm_cost, _amount(spent.llm_cost, self.budget.max_llm_cost or 0, "", 4)),
        }
        for name, (done, amount) in values.items():
            if name in self.tasks_by_budget:
                self.update(self.tasks_by_budget[name], completed=done, amount=amount)
        for problem, p in progress.problems.items():
            line = self.problems.setdefault(problem, {"last": ""})
            line["evaluations"] = p.evaluations
            if p.best_speedup is None:
                line["best"] = "no correct candidate yet"
            elif p.interpreted:
                line["best"] = "interpreted timings: no speed figure"
            else:
                line["best"] = f"best {ratio(p.best_speedup)} over {p.baseline}"

    def get_renderables(self):
        if "wall" in self.tasks_by_budget:
            wall = self._wall_s + time.monotonic() - self._wall_at
            self.update(
                self.tasks_by_budget["wall"],
                completed=min(wall, self.budget.max_wall_s),
                amount=_amount(wall, self.budget.max_wall_s, " s"),
            )
        yield from super().get_renderables()
        if self.plan:
            yield Text(f"plan: {self.plan}", overflow="fold")
        table = Table.grid(padding=(0, 2))
        for problem, line in self.problems.items():
            table.add_row(problem, f"{line['evaluations']} evaluated", line["best"], line["last"])
        yield table


class _ProgressEvents:
    def __init__(self, display: _CampaignProgress) -> None:
        self.display = display

    def evaluated(self, result: EvalResult, best_speedup: float | None) -> None:
        line = self.display.problems.setdefault(result.problem, {"evaluations": 0, "best": ""})
        line["last"] = f"last: {result.status.value}"

    def progress(self, progress: CampaignProgress) -> None:
        self.display.report(progress)

    def message(self, text: str) -> None:
        self.display.console.print(text)


def _run_with_progress(start, config):
    with _CampaignProgress(config, console=console) as progress:
        return start(_ProgressEvents(progress))


def _print_outcome(outcome) -> None:
    console.print(f"campaign [bold]{outcome.campaign_id}[/] finished: {outcome.stop_reason}")
    # On the interpreter the best is the first correct proposal (what is registered), not a speed.
    how = " (first correct proposal; interpreted timings rank nothing)" if outcome.interpreted else ""
    for problem, cid in outcome.best.items():
        console.print(f"  best {problem}: candidate {cid}{how}")
    for kernel_id in outcome.registered:
        console.print(f"  registered [green]{kernel_id}[/] in {outcome.library}")
    console.print(f"result: {outcome.library / 'manifest.json'}")
    console.print(f"report: {outcome.report} and {outcome.report.with_suffix('.html')}")


@campaign_app.command("run")
def campaign_run(
    config: Annotated[Path, typer.Argument(help="campaign TOML file")], home: HomeOption = None
) -> None:
    """Start a campaign from a TOML config."""
    from agent.campaign import CampaignError, Campaigns
    from agent.config import ConfigError, load_config

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    campaigns = Campaigns(home)
    campaign_id = campaigns.new_id(cfg)
    console.print(f"campaign [bold]{campaign_id}[/] starting (home {campaigns.home})")
    with _resumable(campaign_id, campaigns):
        try:
            outcome = _run_with_progress(lambda ev: campaigns.start(cfg, ev, campaign_id), cfg)
        except CampaignError as exc:
            raise fail(str(exc)) from None
    _print_outcome(outcome)


class _Terminated(BaseException):
    """SIGTERM or SIGHUP (a job scheduler's stop, a closed terminal) in a running campaign: a
    BaseException like KeyboardInterrupt, so that nothing between here and the signal takes it
    for the campaign's own error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum: int, _frame) -> None:
    raise _Terminated(signum)


@contextlib.contextmanager
def _resumable(campaign_id: str, campaigns):
    """On Ctrl-C, SIGTERM, SIGHUP or any failure of a running campaign, the exact command that
    continues it."""
    resume = f"recforge campaign resume {campaign_id}"
    if campaigns.home != Path(".recforge"):
        resume += f" --home {campaigns.home}"
    stops = (signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, _terminate) for s in stops}
    try:
        yield
    except KeyboardInterrupt:
        err.print(f"stopped; continue it with: {resume}")
        raise typer.Exit(130) from None
    except _Terminated as stop:
        err.print(f"stopped by {stop}; continue it with: {resume}")
        raise typer.Exit(128 + stop.signum) from None
    except typer.Exit:
        if campaigns.store.campaign(campaign_id) is not None:
            err.print(f"stopped; continue it with: {resume}")
        raise
    except Exception:
        err.print(f"stopped by an error; once fixed, continue it with: {resume}")
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _campaign_row(campaigns, campaign_id: str):
    row = campaigns.store.campaign(campaign_id)
    if row is None:
        raise fail(f"no campaign {campaign_id!r} in {campaigns.home}; `recforge campaign list` shows them")
    return row


@campaign_app.command("resume")
def campaign_resume(campaign_id: str, home: HomeOption = None) -> None:
    """Continue a stopped or killed campaign from its last checkpoint."""
    from agent.campaign import CampaignError
    from agent.config import CampaignConfig

    campaigns = _existing_campaigns(home)
    row = _campaign_row(campaigns, campaign_id)
    if row.status == "finished":
        raise fail(
            f"campaign {campaign_id} already finished ({row.stop_reason or 'finished'}); "
            f"see `recforge campaign status {campaign_id}`"
        )
    config = CampaignConfig.model_validate_json(row.config_json)
    with _resumable(campaign_id, campaigns):
        try:
            outcome = _run_with_progress(lambda ev: campaigns.resume(campaign_id, ev), config)
        except CampaignError as exc:
            raise fail(str(exc)) from None
    _print_outcome(outcome)


def _last_registration(home: Path | None) -> tuple[str, str] | None:
    """(campaign, library) of the kernel a campaign in `home` registered last, or None (no store
    there is no error here, and none is made)."""
    from agent.campaign import default_home
    from agent.store import Store

    root = Path(home) if home else default_home()
    return Store(root / "store.db").last_accepted() if (root / "store.db").exists() else None


def _existing_campaigns(home: Path | None):
    """The campaigns of `home`, whose store must exist: commands that read campaigns never
    create a state folder."""
    from agent.campaign import Campaigns, default_home

    root = Path(home) if home else default_home()
    if not (root / "store.db").exists():
        raise fail(f"no campaigns in {root} (no store.db); `recforge campaign run CONFIG` starts one", 1)
    return Campaigns(root)


@campaign_app.command("report")
def campaign_report(
    campaign_id: str,
    home: HomeOption = None,
    output: Annotated[
        Path | None, typer.Option(help="folder to write into (default: the config's output_dir / ID)")
    ] = None,
) -> None:
    """Write a campaign's report: Markdown and a self-contained HTML page with its plots."""
    from agent.campaign import CampaignError

    campaigns = _existing_campaigns(home)
    _campaign_row(campaigns, campaign_id)
    try:
        files = campaigns.report(campaign_id, output)
    except CampaignError as exc:
        raise fail(str(exc)) from None
    console.print(f"report: {files.markdown}")
    console.print(f"report: {files.html}")


@campaign_app.command("list")
def campaign_list(home: HomeOption = None) -> None:
    """Campaigns in this home, newest first."""
    from agent.campaign import default_home

    root = Path(home) if home else default_home()
    if not (root / "store.db").exists():
        console.print(f"no campaigns in {root}")
        return
    campaigns = _existing_campaigns(root)
    table = _table("id", "status", "evaluations", "wall s", "stop reason", "created")
    for c in campaigns.store.campaigns():
        table.add_row(
            c.id,
            c.status,
            str(campaigns.store.count_evaluations(c.id)),
            f"{c.wall_s:.0f}",
            c.stop_reason or "",
            c.created_at,
        )
    console.print(table)


@campaign_app.command("status")
def campaign_status(campaign_id: str, home: HomeOption = None) -> None:
    """Evaluations, statuses and best candidates of one campaign."""
    from collections import Counter

    campaigns = _existing_campaigns(home)
    row = _campaign_row(campaigns, campaign_id)
    rows = campaigns.store.evaluations(campaign_id)
    gpu_s = campaigns.store.device_seconds(campaign_id)
    console.print(
        f"[bold]{row.id}[/]: {row.status} {row.stop_reason or ''}; wall {row.wall_s:.0f} s, GPU {gpu_s:.1f} s"
    )
    counts = Counter(r.result.status.value for r in rows)
    console.print("statuses: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    spent = campaigns.store.llm_spent(campaign_id)
    if spent.requests:
        pauses = campaigns.store.llm_pauses(campaign_id)
        console.print(
            f"LLM: {spent.requests} requests ({spent.failed_requests} failed), {spent.tokens} tokens "
            f"({spent.prompt_tokens} prompt, {spent.completion_tokens} completion), cost {spent.cost:.4f}"
            + (f"; paused {len(pauses)} time(s), last: {pauses[-1][2]}" if pauses else "")
        )
        # Per request, what came of it: replied, context_overflow, structured_output_refused, auth, ...
        outcomes = Counter(e["outcome"] for e in campaigns.store.llm_exchanges(campaign_id))
        console.print("LLM requests by outcome: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()))
    endpoint = campaigns.store.llm_preflight(campaign_id)
    if endpoint is not None:
        console.print(f"LLM endpoint at the last start: {endpoint.summary()}")
    correct = [r for r in rows if r.score_us is not None]
    if not any(r.result.interpreted for r in correct):
        correct.sort(key=lambda r: r.score_us)  # interpreted timings rank nothing: evaluation order
    for r in correct[:5]:
        tag = " (interpreted)" if r.result.interpreted else ""
        console.print(f"  {r.candidate.id} {r.score_us:.1f} us{tag} knobs {json.dumps(r.candidate.knobs)}")
    for problem, _, kernel_id, library in campaigns.store.accepted(campaign_id):
        console.print(f"  accepted {problem}: {kernel_id} in {library}")


@sandbox_app.command("eval")
def sandbox_eval(
    problem: Annotated[str, typer.Option(help="problem name, e.g. embedding_bag")],
    source: Annotated[Path, typer.Option(help="candidate module source file")],
    entry: Annotated[
        str | None,
        typer.Option(
            help="entry function (default: the problem's, or its template's where the source defines that)"
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(help="hard wall-clock limit in seconds")] = 300.0,
    timing: Annotated[bool, typer.Option(help="time the candidate after checking it")] = True,
    baselines: Annotated[
        bool, typer.Option(help="also time the reference, torch.compile of it and eager PyTorch")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print the EvalResult as JSON")] = False,
) -> None:
    """Check and time one candidate in an isolated worker process."""
    from sandbox import Candidate, Status
    from sandbox.protocol import campaign_baselines
    from search_space import get_problem

    try:
        prob = get_problem(problem)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if not source.is_file():
        raise fail(f"source file {source} does not exist")
    try:
        text = source.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise fail(f"cannot read {source}: {exc}") from None
    candidate = Candidate(
        problem=prob.name, source=text, entry=entry or _default_entry(prob, text), origin="human"
    )
    result = local_backend(timeout_s=timeout).evaluate(
        candidate, timing=timing, baselines=campaign_baselines(prob) if baselines else []
    )
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        console.print(f"{candidate.id}: [bold]{result.status.value}[/] {result.message}")
        tag = " (interpreted)" if result.interpreted else ""
        for t in result.timings:
            vs = ", ".join(
                f"{ratio(b.median_us / t.candidate.median_us)} vs {n}" for n, b in t.baselines.items()
            )
            console.print(
                f"  {t.shape} {t.dtype}: {t.candidate.median_us:.1f} us{tag}, {t.achieved_gbps:.0f} GB/s {vs}"
            )
    if result.status != Status.OK:
        if not as_json:
            err.print(f"[red]candidate not accepted:[/] {result.status.value}: {result.message}")
        raise typer.Exit(1)


@library_app.command("list")
def library_list(
    library: Annotated[Path | None, typer.Option(help="library folder (default: the package's)")] = None,
    home: HomeOption = None,
) -> None:
    """Accepted kernels with their keys and evidence (and, listing the package's library, where
    the last campaign of `--home` registered its kernels, when that is another library)."""
    from kernels.registry import DISPATCHER, KernelLibrary

    lib = KernelLibrary(library) if library else DISPATCHER.library
    try:
        entries = lib.entries()
    except ValueError as exc:
        raise fail(str(exc)) from None
    # Reasons (refused, demoted) follow the table as whole lines.
    table = _table(
        "kernel", "key", "buckets (training)", "median us", "from", "state",
        title=f"kernel library {lib.root}", title_justify="left",
    )  # fmt: skip
    notes = []
    for e in entries:
        median = (
            "n/a" if e.median_us is None else f"{e.median_us:.1f}" + (" interp." if e.interpreted else "")
        )
        training = "" if e.train_buckets is None else f" ({','.join(e.train_buckets) or 'none'})"
        why = e.demoted or lib.refusal(e)
        state = "demoted" if e.demoted else ("dispatched" if why is None else "refused")
        if why is not None:
            notes.append(f"{state}: {e.kernel_id} ({e.dtype}, {e.arch}): {why}")
        table.add_row(
            e.kernel_id, f"{e.op} {e.dtype} {e.arch}", ",".join(e.buckets) + training, median,
            f"{e.provenance.get('campaign', '')} {e.registered_at}".strip(), state,
        )  # fmt: skip
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True)
    if library is None:
        last = _last_registration(home)
        if last is not None and Path(last[1]).resolve() != Path(lib.root).resolve():
            console.print(
                f"the last campaign, {last[0]}, registered into {last[1]}: "
                f"recforge library list --library {last[1]}",
                soft_wrap=True,
            )
        else:
            console.print("[dim]another library: recforge library list --library PATH[/]")
    if not entries:
        console.print("no accepted kernels yet: dispatch uses the default kernels")


# --- review ------------------------------------------------------------------------------------

_REPO_OPTION = typer.Option(help="the git repository holding the changes (default: this checkout)")


def _review_repo(repo: Path | None) -> Path:
    from agent import review

    try:
        return review.repository(repo if repo is not None else Path(__file__).resolve().parents[1])
    except review.ReviewError as exc:
        raise fail(str(exc), 1) from None


@review_app.command("list")
def review_list(repo: Annotated[Path | None, _REPO_OPTION] = None) -> None:
    """Kernel changes with their state and headline speedups."""
    from agent import review

    root = _review_repo(repo)
    try:
        changes = review.list_changes(root)
    except review.ReviewError as exc:
        raise fail(str(exc), 1) from None
    table = _table(
        "id",
        "op",
        "dtype",
        "buckets",
        "status",
        "headline",
        title=f"kernel changes in {root}",
        title_justify="left",
    )
    for c in changes:
        status = c.status if c.reason is None else f"{c.status}: {c.reason}"
        table.add_row(c.id, c.op, c.dtype, ", ".join(c.buckets), status, c.headline)
    console.print(table)
    if not changes:
        console.print("no kernel changes yet: a campaign opens one for each kernel it accepts")


@review_app.command("show")
def review_show(change: str, repo: Annotated[Path | None, _REPO_OPTION] = None) -> None:
    """A change's description and diff, and its kernel's source."""
    from rich.syntax import Syntax

    from agent import review

    root = _review_repo(repo)
    try:
        found, patch, source, evidence = review.show(root, change)
    except review.ReviewError as exc:
        raise fail(str(exc), 1) from None
    console.print(f"[bold]{found.id}[/] {found.status} on branch {found.branch}")
    _print_evidence(evidence)
    console.print(Syntax(patch, "diff", word_wrap=True))
    console.print(Syntax(source, "python", line_numbers=True, word_wrap=True))


def _print_evidence(evidence: dict) -> None:
    """A change's evidence in brief: who proposed it, its lineage, and its timings per shape
    against each baseline the evaluation measured (the whole record is in the diff)."""
    lineage = " <- ".join(evidence.get("lineage") or [])
    console.print(
        f"evidence: {evidence.get('headline') or 'no headline'}; proposer {evidence.get('proposer') or '?'}"
        f"; prompt hash {evidence.get('prompt_hash') or '-'}; lineage {lineage or '-'}"
    )
    timings = (evidence.get("evaluation") or {}).get("timings") or []
    if not timings:
        return
    names = sorted({name for t in timings for name in t.get("baselines", {})})
    table = _table("shape", "dtype", "bucket", "us", *(f"{n} us" for n in names), title="timings")
    for t in timings:
        base = t.get("baselines", {})
        table.add_row(
            t["shape"], t["dtype"], t.get("bucket") or "", f"{t['candidate']['median_us']:.1f}",
            *(f"{base[n]['median_us']:.1f}" if n in base else "" for n in names),
        )  # fmt: skip
    console.print(table)


@review_app.command("reject")
def review_reject(
    change: str,
    reason: Annotated[str, typer.Option(help="why (the next proposals for the op are shown it)")],
    repo: Annotated[Path | None, _REPO_OPTION] = None,
) -> None:
    """Reject a change, with the reason recorded in the repository."""
    from agent import review

    try:
        done, library = review.reject(_review_repo(repo), change, reason)
    except review.ReviewError as exc:
        raise fail(str(exc), 1) from None
    console.print(f"{done.id} rejected: {done.reason}")
    if library is not None:
        console.print(f"its kernel no longer dispatches from {library} (demoted there)")


@review_app.command("approve")
def review_approve(
    change: str,
    repo: Annotated[Path | None, _REPO_OPTION] = None,
    timeout: Annotated[
        float, typer.Option(help="hard wall-clock limit of each evaluation (the kernel's, its default's)")
    ] = 600.0,
) -> None:
    """Re-verify a change's kernel on this machine's device (checks, and on a GPU of its
    architecture its timings beside the op's default kernel), then merge it into the library
    branch."""
    from agent import review
    from agent.incumbents import campaign_arch

    def verify(source, entry) -> str | None:
        with tempfile.TemporaryDirectory(prefix="recforge-approve-") as scratch:
            backend = local_backend(timeout_s=timeout, scratch_root=Path(scratch))
            return review.reverify(source, entry, backend.evaluate, campaign_arch())

    try:
        done = review.approve(_review_repo(repo), change, verify)
    except review.ReviewError as exc:
        raise fail(str(exc), 1) from None
    console.print(f"{done.id} approved: merged into {review.LIBRARY_BRANCH}")


@library_app.command("verify")
def library_verify(
    library: Annotated[Path | None, typer.Option(help="library folder (default: the package's)")] = None,
    timeout: Annotated[float, typer.Option(help="hard wall-clock limit per evaluation")] = 600.0,
) -> None:
    """Check and time every entry of this machine's architecture again; demote what fails or is
    no longer faster than the default kernel (or than another entry, on every bucket it serves),
    record the new times, and show what dispatch runs now where that changed."""
    from agent.incumbents import campaign_arch
    from agent.library_verify import verify_library
    from kernels.registry import DISPATCHER, KernelLibrary

    lib = KernelLibrary(library) if library else DISPATCHER.library
    with tempfile.TemporaryDirectory(prefix="recforge-verify-") as scratch:
        try:
            rows, changed = verify_library(
                lib, local_backend(timeout_s=timeout, scratch_root=Path(scratch)), campaign_arch()
            )
        except ValueError as exc:
            raise fail(str(exc)) from None
    table = _table(
        "kernel", "op", "dtype", "outcome", "detail", title=f"verified {lib.root} on {campaign_arch()}"
    )
    for row in rows:
        table.add_row(row.entry.kernel_id, row.entry.op, row.entry.dtype, row.outcome, row.detail)
    console.print(table)
    if changed:
        choices = _table("op", "dtype", "bucket", "dispatch ran", "dispatch runs now", title="what changed")
        for c in changed:
            ran, runs = c.before or "default kernel", c.after or "default kernel"
            choices.add_row(c.op, c.dtype, c.bucket, ran, runs)
        console.print(choices)
    demoted = sum(row.outcome == "demoted" and not row.detail.startswith("already") for row in rows)
    console.print(f"{len(rows)} entries, {demoted} demoted now" if rows else "the library is empty")


@library_app.command("export")
def library_export(
    path: Annotated[Path, typer.Argument(help="the bundle to write (a .tar.gz)")],
    library: Annotated[Path | None, typer.Option(help="library folder (default: the package's)")] = None,
    include_demoted: Annotated[bool, typer.Option(help="carry demoted entries too")] = False,
) -> None:
    """Write the library's kernels (sources, manifest, evidence) as a versioned bundle that a
    training job installs with `python -m kernels.bundle install PATH` (recforge[worker] only)."""
    from kernels import bundle
    from kernels.registry import DISPATCHER

    root = library if library else DISPATCHER.library.root
    try:
        index = bundle.export(root, path, include_demoted=include_demoted)
    except (bundle.BundleError, ValueError) as exc:
        raise fail(str(exc)) from None
    console.print(bundle.describe(index), soft_wrap=True)
    console.print(f"wrote {path} ({len(index['entries'])} kernels)")


@library_app.command("import")
def library_import(
    path: Annotated[Path, typer.Argument(help="a bundle written by `recforge library export`")],
    library: Annotated[Path | None, typer.Option(help="library folder (default: the package's)")] = None,
) -> None:
    """Check a bundle (format, checksums, source hashes) and merge its kernels into the library."""
    from kernels import bundle
    from kernels.registry import DISPATCHER

    try:
        done = bundle.install(path, library if library else DISPATCHER.library.root)
    except bundle.BundleError as exc:
        raise fail(str(exc)) from None
    console.print(
        f"installed {len(done.added)} kernels into {done.library} "
        f"({len(done.replaced)} replaced, {done.kept} kept)"
    )
    for label in done.added:
        console.print(f"  {label}", soft_wrap=True)


@bench_app.command("dispatch")
def bench_dispatch(
    calls: Annotated[int, typer.Option(min=100, help="resolves per measurement")] = 20_000,
) -> None:
    """Host microseconds dispatch takes to choose the kernel for one call, and per op what every
    call pays before its kernel: its shape bucket and the choice for it."""
    from evals.bench_dispatch import run_dispatch_benchmark, run_op_dispatch_benchmark

    result = run_dispatch_benchmark(calls=calls)
    table = _table(
        "choice", "us per call", "spread us", title=f"dispatch on {result['device']} ({result['arch']})"
    )
    for name, row in result["rows"].items():
        table.add_row(name, f"{row['us_per_call']:.2f}", f"{row['spread']:.2f}")
    console.print(table)
    per_op = run_op_dispatch_benchmark(calls=max(100, calls // 4))
    table = _table("op", "bucket", "bucket us", "bucket and choice us", title="per op, before its kernel")
    for name, row in per_op["rows"].items():
        table.add_row(name, row["bucket"], f"{row['bucket_us']:.2f}", f"{row['total_us']:.2f}")
    console.print(table)


@bench_app.command("sandbox")
def bench_sandbox(
    candidates: Annotated[int, typer.Option(min=2, help="candidates in the realistic mix")] = 30,
    backend: Annotated[str, typer.Option(help="local, docker or ray")] = "local",
    timeout: Annotated[float, typer.Option(help="hard wall-clock limit per evaluation")] = 300.0,
    parallel: Annotated[int, typer.Option(help="local backend: workers at once (timing takes turns)")] = 1,
) -> None:
    """Evaluations per hour on a realistic candidate mix (most correct, a third wrong, a few crash)."""
    from agent.campaign import CampaignError, make_backend
    from agent.config import SandboxConfig
    from evals.bench_sandbox import run_sandbox_benchmark
    from sandbox.protocol import all_baselines
    from search_space import get_problem

    try:
        config = SandboxConfig(backend=backend, timeout_s=timeout, parallel_workers=parallel)
    except ValueError as exc:
        raise fail(f"bad option: {exc}") from None
    names = all_baselines(get_problem("embedding_bag"))
    scratch = Path(tempfile.mkdtemp(prefix="recforge-bench-"))
    try:
        try:
            backend = make_backend(config, scratch / "scratch", scratch / "artifacts")
        except CampaignError as exc:
            raise fail(str(exc)) from None
        run_sandbox_benchmark(backend, candidates, baselines=names, console=console)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@bench_app.command("ops")
def bench_ops(
    op: Annotated[str | None, typer.Option(help="op to benchmark, e.g. embedding_bag")] = None,
    family: Annotated[
        str | None, typer.Option(help="every op of a family: embedding, attention or all")
    ] = None,
    library: Annotated[Path | None, typer.Option(help="library whose best kernel to include")] = None,
    output: Annotated[Path | None, typer.Option(help="append result rows to this JSON-lines file")] = None,
    shape: Annotated[
        list[str] | None, typer.Option(help="only timing shapes whose name contains this (repeatable)")
    ] = None,
    without: Annotated[
        list[str] | None, typer.Option(help="leave out this provider, e.g. reference.compile (repeatable)")
    ] = None,
    passes: Annotated[
        str | None, typer.Option(help="attention ops: comma-separated among fwd, bwd, fwd+bwd")
    ] = None,
) -> None:
    """Time reference, torch.compile, eager PyTorch, default and best registered kernels
    (attention ops: forward, backward and both, in TFLOP/s against the measured matmul peak)."""
    if (op is None) == (family is None):
        raise fail("give one of --op NAME or --family embedding|attention|all")
    _interpret_without_gpu()
    from evals.bench_ops import run_family_benchmark, run_op_benchmark

    if output:
        try:
            output.open("a").close()
        except OSError as exc:
            raise fail(f"--output {output}: {exc.strerror}") from None

    def on_row(row: dict) -> None:
        # Each row is appended as soon as it is measured, so a run cut short keeps its rows.
        if output:
            with output.open("a") as f:
                f.write(json.dumps(row) + "\n")

    options = {
        "library": library,
        "console": console,
        "only_shapes": shape,
        "without": without,
        "passes": tuple(p.strip() for p in passes.split(",")) if passes else None,
        "on_row": on_row,
    }
    try:
        run_op_benchmark(op, **options) if op else run_family_benchmark(family, **options)
    except ValueError as exc:
        raise fail(str(exc)) from None


def _default_entry(problem, source: str) -> str:
    """The problem's entry; the template's (the default kernel's own, embedding_bag_forward for
    embedding_bag) where the source defines that one and not the problem's."""
    import ast

    from search_space.template import get_template, parse_source

    try:
        defined = {n.name for n in parse_source(source).body if isinstance(n, ast.FunctionDef)}
    except SyntaxError:
        return problem.entry  # the screen says what is wrong
    if problem.entry in defined or problem.template is None:
        return problem.entry
    template_entry = get_template(problem.name).entry
    return template_entry if template_entry in defined else problem.entry


def main() -> None:  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())


@llm_app.command("check")
def llm_check(config: Annotated[Path, typer.Argument(help="campaign TOML file")]) -> None:
    """The campaign's pre-flight check of its LLM endpoint, alone: the server answers, the key
    works, the model is served, its context holds the largest first prompt beside
    llm.max_tokens, and (structured_output = "auto") which structured-output form it takes."""
    from agent.campaign import check_llm_endpoint
    from agent.config import ConfigError, load_config

    try:
        cfg = load_config(config)
        if cfg.llm is None:
            raise fail(f"{config} has no [llm] section: nothing to check")
        found = check_llm_endpoint(cfg)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    console.print(f"ok: {found.summary()}; max_tokens {cfg.llm.max_tokens}")
