"""The campaign report: `recforge campaign report ID` writes Markdown and a self-contained HTML
page from the store, and the page renders with its plots in a real (headless) browser.

One LLM-and-search campaign on the quick backend feeds every test: a broken and a wrong kernel
from the model, an outage pause, knob proposals, the incumbent, and a registered winner."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from llm_helpers import BROKEN, KEY, KEY_ENV, WRONG, config, knob_replies
from llm_server import Fail, FakeLLMServer, Reply, proposal
from quick_backend import QuickBackend
from typer.testing import CliRunner

import agent.campaign
from agent.campaign import Campaigns
from agent.cli import app
from agent.store import device_seconds
from kernels.registry import KernelLibrary

PHASES = {"load": 0.5, "check": 0.25, "timing": 0.5}
CHROMIUM = next((p for name in ("chromium", "chromium-browser") if (p := shutil.which(name))), None)


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("report")
    # What dispatch runs today is slowest, and each evaluation faster than the one before: by
    # its interpreted timings the last correct proposal is the fastest, but on the interpreter
    # the best is the first correct one, the one registered.
    order = itertools.count()
    backend = QuickBackend(
        phase_s=PHASES, speed=lambda c: 500.0 if c.origin == "library" else 100.0 - 5 * next(order)
    )
    script = [
        Reply(proposal("module", source=BROKEN), prompt_tokens=100, completion_tokens=50),
        Reply(proposal("module", source=WRONG), prompt_tokens=100, completion_tokens=50),
        # One failed request (a rate limit, retried once, then a server error) pauses the LLM
        # (outage_failures = 1), briefly.
        Fail(429, {"retry-after-ms": "1"}, message="Rate limit reached for requests"),
        Fail(500),
    ]
    with pytest.MonkeyPatch.context() as mp, FakeLLMServer(script, default=knob_replies(100, 50)) as server:
        mp.setenv(KEY_ENV, KEY)
        mp.setattr(agent.campaign, "make_backend", lambda *a, **k: backend)
        cfg = config(
            tmp,
            server.url,
            proposer={"kinds": ["llm", "search"], "batch_size": 2},
            llm={"max_retries": 1, "outage_failures": 1, "outage_cooldown_s": 0.2},
            budget={"max_evaluations": 8, "max_wall_s": 600, "max_gpu_s": 100},
        )
        campaigns = Campaigns(tmp / "home")
        outcome = campaigns.start(cfg)
    result = CliRunner().invoke(
        app,
        [
            "campaign",
            "report",
            outcome.campaign_id,
            "--home",
            str(tmp / "home"),
            "--output",
            str(tmp / "rep"),
        ],
    )
    assert result.exit_code == 0, result.output
    return {"tmp": tmp, "outcome": outcome, "store": campaigns.store, "output": result.output}


def test_campaign_end_writes_both_reports(reported) -> None:
    outcome = reported["outcome"]
    assert outcome.report.is_file() and outcome.report.with_suffix(".html").is_file()
    assert (outcome.report.parent / "speedup_over_time.png").read_bytes()[:4] == b"\x89PNG"
    # Written at the end, it says so, with the wall time the store (and the CLI) has.
    text = outcome.report.read_text()
    row = reported["store"].campaign(outcome.campaign_id)
    assert "- status: finished;" in text
    assert f"wall time: {row.wall_s:.0f} s" in text


def test_speedups_too_small_for_two_decimals_keep_their_digits() -> None:
    from agent.report import ratio

    assert [ratio(v) for v in (2.0, 0.5, 0.1, 0.0412, 0.00123, 0.0)] == [
        "2.00x", "0.50x", "0.10x", "0.0412x", "0.00123x", "0.00x",
    ]  # fmt: skip


def test_report_command_tables(reported) -> None:
    tmp, store, cid = reported["tmp"], reported["store"], reported["outcome"].campaign_id
    md = (tmp / "rep" / "report.md").read_text()
    assert str(tmp / "rep" / "report.html") in reported["output"]
    rows = store.evaluations(cid)
    statuses = [r.result.status.value for r in rows]
    assert {"compile_error", "wrong"} <= set(statuses)

    # Summary: previous best (the incumbent, measured here), new best, evidence. On the
    # interpreter the best is what was registered, the first correct proposal, though a later
    # one timed faster; no speedup or roofline is made of interpreted timings.
    incumbent = next(r for r in rows if r.candidate.origin == "library")
    proposals = [r for r in rows if r.score_us is not None and r.candidate.origin != "library"]
    best = next(r for r in rows if r.candidate.id == reported["outcome"].best["embedding_bag"])
    [(_, registered, _, _)] = store.accepted(cid)
    assert best is proposals[0] and best.candidate.id == registered
    assert min(proposals, key=lambda r: r.score_us) is not best
    summary = next(line for line in md.splitlines() if line.startswith("| embedding_bag (interpreted) |"))
    cells = [c.strip() for c in summary.strip("|").split("|")]
    assert cells[1:4] == ["100.0", "100.0", "torch.embedding_bag 100.0"]  # the quick backend's baselines
    assert cells[4:9] == [
        f"{incumbent.score_us:.1f}",
        f"{best.score_us:.1f}",
        "interpreted",
        "interpreted",
        "interpreted",
    ]
    assert "x" not in "".join(cells[4:9]) and "Speedup: none, the timings are interpreted." in md
    assert cells[9] == "2 of 2 (2 shapes, 1 trial(s) each)" and cells[10] == "not run"
    assert cells[11].startswith("ok (")  # re-verified in a fresh worker before registration
    assert "interpreter on a CPU" in md

    # Failure statistics: every status, counted as the store has them.
    for status in (
        "ok",
        "wrong",
        "compile_error",
        "runtime_error",
        "timeout",
        "static_rejected",
        "suspicious",
    ):
        n = statuses.count(status)
        assert f"| {status} | {n} | {n} |" in md, status

    # Budgets: GPU seconds are the check and timing phases, summed from the store.
    gpu = sum(device_seconds(r.result) for r in rows)
    assert gpu == pytest.approx(store.device_seconds(cid)) and gpu > 0
    assert f"| GPU seconds | 100.0 | {gpu:.1f} | {100 - gpu:.1f} |" in md

    # LLM spend and the outage pause.
    spent = store.llm_spent(cid)
    assert f"- tokens: {spent.tokens} ({spent.prompt_tokens} prompt" in md
    [(_, _, reason)] = store.llm_pauses(cid)
    assert reason.replace("|", "/") in md
    [outcomes] = [line for line in md.splitlines() if line.startswith("- outcomes: ")]
    # How many proposals come after the pause depends on how fast the evaluations run beside it.
    proposals = sum(e["outcome"] == "proposal" for e in store.llm_exchanges(cid))
    assert proposals >= 2 and outcomes == f"- outcomes: proposal {proposals}, rate_limited 1, http_500 1", (
        outcomes
    )

    # Accepted kernels: a link to the source file the library holds, and the lineage.
    [(_, candidate_id, kernel_id, library)] = store.accepted(cid)
    link = re.search(rf"\[{kernel_id}\.py\]\(([^)]+)\)", md).group(1)
    assert (tmp / "rep" / link).resolve() == (Path(library) / f"{kernel_id}.py").resolve()
    assert (tmp / "rep" / link).is_file()
    lineage = f"`{candidate_id}` ({store.candidate(cid, candidate_id).origin})"
    assert lineage in md
    # The buckets it serves (on the interpreter: every one, training included: no statistics).
    [entry] = [e for e in KernelLibrary(library).entries() if e.kernel_id == kernel_id]
    row_of = next(line for line in md.splitlines() if f"`{kernel_id}`" in line)
    assert f"| {', '.join(entry.buckets)} |" in row_of


def test_report_unknown_campaign_is_one_clear_error(tmp_path: Path) -> None:
    from agent.store import Store

    Store(tmp_path / "store.db")
    result = CliRunner().invoke(app, ["campaign", "report", "nope", "--home", str(tmp_path)])
    assert result.exit_code == 2 and "no campaign 'nope'" in result.output
    assert "Traceback" not in result.output


def test_html_report_is_self_contained(reported) -> None:
    html = (reported["tmp"] / "rep" / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == 2
    # No external assets: nothing loaded from elsewhere (the only links are the kernel sources).
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="(?!data:)', html)
    assert "interpreted" in html and "Failed" not in html


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH; `make browser` installs Debian's chromium (as root)"
)
def test_html_report_renders_with_its_plots_in_a_browser(reported, tmp_path: Path) -> None:
    import matplotlib.image

    url = (reported["tmp"] / "rep" / "report.html").resolve().as_uri()
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    base.append(f"--user-data-dir={tmp_path / 'profile'}")
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=60).stdout
    # The page's own script marks each plot with the size it decoded to, once the page has loaded.
    assert 'data-plots-checked="true"' in dom, dom[-2000:]
    sizes = re.findall(r'data-decoded="(\d+)x(\d+)"', dom)
    assert len(sizes) == 2 and all(int(w) > 300 and int(h) > 200 for w, h in sizes), sizes
    assert 'data-decoded="no"' not in dom

    shot = tmp_path / "report.png"
    subprocess.run(
        [*base, "--window-size=1300,1100", f"--screenshot={shot}", url],
        capture_output=True,
        timeout=60,
        check=True,
    )
    pixels = matplotlib.image.imread(shot)[..., :3]  # (H, W, 3) in [0, 1]
    assert pixels.std() > 0.05, "the page rendered blank"
    # The plots' lines are matplotlib's first colour (tab:blue, #1f77b4); nothing else on the page is.
    blue = (abs(pixels - (0x1F / 255, 0x77 / 255, 0xB4 / 255)).max(axis=-1) < 0.08).sum()
    assert blue > 500, f"only {blue} plot-line pixels in the screenshot"


def test_the_plots_show_the_speedup_over_the_previous_best(reported) -> None:
    """What dispatch ran at the start is 1.0x; each correct candidate is plotted at the previous
    best's time over its own (on the interpreter too, where a compiled baseline would flatten
    every line near zero)."""
    from agent.report import _problem, _series

    store, outcome = reported["store"], reported["outcome"]
    cid = outcome.campaign_id
    [problem] = [_problem(store, cid, p, outcome.best.get(p), []) for p in outcome.best]
    [series] = _series(store, cid, store.campaign(cid).created_at, [problem])
    assert series.baseline == "previous best" and problem.previous is not None
    correct = [r for r in problem.rows if r.score_us is not None]
    assert series.speedup == pytest.approx([problem.previous.score_us / r.score_us for r in correct])
    assert 1.0 in series.speedup  # the incumbent itself
