"""Campaign loop end to end: run in a child process, SIGKILL it mid-run, resume, finish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent.campaign import CampaignError, Campaigns
from agent.store import Store
from kernels.registry import KernelLibrary
from sandbox.result import Status

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, max_evaluations: int) -> Path:
    path = tmp_path / "campaign.toml"
    path.write_text(
        textwrap.dedent(f"""
        name = "t"
        problems = ["embedding_bag"]
        output_dir = "{tmp_path / "out"}"
        library = "{tmp_path / "library"}"
        [proposer]
        batch_size = 2
        seed = 3
        [budget]
        max_evaluations = {max_evaluations}
        max_wall_s = 600
        [sandbox]
        timeout_s = 120
        trials = 2
    """)
    )
    return path


@pytest.mark.slow
def test_killed_campaign_resumes_and_finishes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    # A relative home, as users give it: workers run elsewhere and must still find their files.
    env = {**os.environ, "RECFORGE_HOME": "home", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "campaign", "run", str(_config(tmp_path, 3))],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if (home / "store.db").exists():
                campaigns = Store(home / "store.db").campaigns()
                if campaigns and Store(home / "store.db").count_evaluations(campaigns[0].id) >= 1:
                    break
        else:
            pytest.fail("the campaign evaluated nothing within 120 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no clean shutdown: the worst case for resume
        proc.wait()

    campaigns = Campaigns(home)
    [row] = campaigns.store.campaigns()
    done_before = campaigns.store.count_evaluations(row.id)
    assert 1 <= done_before < 3
    assert row.status == "running"  # it never got to say otherwise

    outcome = campaigns.resume(row.id)

    rows = campaigns.store.evaluations(row.id)
    ids = [r.candidate.id for r in rows]
    assert len(ids) == 3 and len(set(ids)) == 3, "evaluations were lost or repeated"
    assert [r.result.status for r in rows] == [Status.OK] * 3, [r.result.message for r in rows]
    assert outcome.stop_reason.startswith("evaluation budget reached")
    assert outcome.best["embedding_bag"] in ids
    assert rows[0].candidate.origin == "library"  # what dispatch runs today is measured first
    # On the interpreter timings decide nothing, so the fastest correct proposal is registered
    # (labelled interpreted), after re-verification, with its evidence and lineage.
    [entry] = KernelLibrary(tmp_path / "library").entries()
    proposals = [r for r in rows if r.score_us is not None and r.candidate.origin != "library"]
    assert entry.source_hash == min(proposals, key=lambda r: r.score_us).candidate.id
    assert entry.provenance["campaign"] == row.id
    assert entry.evidence["reverification"]["status"] == "ok"
    assert entry.interpreted == (entry.arch == "interpreter")
    assert outcome.report.read_text().count("| ok |") >= 1
    assert campaigns.store.campaign(row.id).status == "finished"
    with pytest.raises(CampaignError, match="already finished"):
        campaigns.resume(row.id)
    assert campaigns.store.campaign(row.id).status == "finished"  # a refused resume changes nothing
