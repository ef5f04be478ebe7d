"""`recforge library verify`: entries checked (and, on a GPU, timed) again beside the default
kernel; a wrong one, or one the default now beats, is demoted: kept with its reason, out of
dispatch."""

from __future__ import annotations

from pathlib import Path

import pytest
from quick_backend import QuickBackend
from typer.testing import CliRunner

from agent.cli import app
from agent.library_verify import verify_library
from kernels.registry import KernelLibrary
from sandbox.result import DeviceInfo, EvalResult, ShapeTiming, Status, TimingStats
from search_space.embedding_bag import TEMPLATE

OP = "embedding_bag"
GPU = DeviceInfo(name="gpu", arch="sm_90", torch="t", triton="t", python="p", interpreted=False)


def _add(library: KernelLibrary, source: str, arch: str = "interpreter", median_us: float = 10.0):
    return library.add(
        op=OP,
        entry=TEMPLATE.entry,
        source=source,
        arch=arch,
        dtype="fp32",
        buckets=["d64-long"],
        median_us=median_us,
        interpreted=arch == "interpreter",
        evidence={},
        provenance={},
    )


def test_a_wrong_entry_is_demoted_and_no_longer_dispatched(tmp_path: Path) -> None:
    library = KernelLibrary(tmp_path / "lib")
    good = _add(library, TEMPLATE.render({"BLOCK_L": 8}), median_us=20.0)
    wrong = _add(
        library, TEMPLATE.render({"BLOCK_L": 16}).replace("    return out\n", "    return out * 2\n")
    )
    other = _add(library, TEMPLATE.render({"BLOCK_L": 32}), arch="sm_90")
    assert library.best(OP, "interpreter", "fp32", "d64-long") == wrong  # the faster, until verified
    verified, changed = verify_library(library, QuickBackend(), "interpreter")
    rows = {r.entry.kernel_id: r for r in verified}
    assert rows[good.kernel_id].outcome == "kept"
    assert (
        rows[wrong.kernel_id].outcome == "demoted" and "re-verification wrong" in rows[wrong.kernel_id].detail
    )
    assert rows[other.kernel_id].outcome == "other arch"
    fresh = KernelLibrary(library.root)
    assert fresh.best(OP, "interpreter", "fp32", "d64-long") == good
    [demoted] = [e for e in fresh.entries() if e.demoted]
    assert demoted.kernel_id == wrong.kernel_id and (library.root / demoted.source_file).exists()
    assert [(c.bucket, c.before, c.after) for c in changed] == [("d64-long", wrong.kernel_id, good.kernel_id)]
    again = {r.entry.kernel_id: r.outcome for r in verify_library(fresh, QuickBackend(), "interpreter")[0]}
    assert again[wrong.kernel_id] == "demoted"
    listed = CliRunner().invoke(app, ["library", "list", "--library", str(library.root)])
    assert f"demoted: {wrong.kernel_id} (fp32, interpreter): re-verification wrong" in listed.output
    assert "…" not in listed.output  # ids fold at 80 columns, never cut


class _GpuTimes:
    """A backend reporting GPU timings: `times` by candidate entry source marker."""

    def __init__(self, times: dict[str, float]) -> None:
        self.times = times

    def evaluate(self, candidate, *, timing=True, trials=2, **_) -> EvalResult:
        us = next(t for marker, t in self.times.items() if marker in candidate.source)
        stats = TimingStats(median_us=us, p20_us=us * 0.99, p80_us=us * 1.01, reps=20)
        timing_row = ShapeTiming(
            shape="s",
            dtype="fp32",
            bucket="d64-long",
            candidate=stats,
            flops=1.0,
            bytes=1.0,
            achieved_gbps=1.0,
        )
        return EvalResult(
            status=Status.OK,
            problem=candidate.problem,
            candidate_id=candidate.id,
            timings=[timing_row],
            device=GPU,
        )


def test_an_entry_the_default_now_beats_is_demoted(tmp_path: Path) -> None:
    library = KernelLibrary(tmp_path / "lib")
    slow = _add(library, TEMPLATE.render({"BLOCK_L": 8}) + "# slow\n", arch="sm_90")
    fast = _add(library, TEMPLATE.render({"BLOCK_L": 16}) + "# fast\n", arch="sm_90")
    backend = _GpuTimes({"# slow": 120.0, "# fast": 60.0, "def embedding_bag_forward": 100.0})
    rows = {r.entry.kernel_id: r for r in verify_library(library, backend, "sm_90")[0]}
    assert rows[slow.kernel_id].outcome == "demoted"
    assert (
        "the default kernel is faster on its buckets (100.0 us against 120.0 us)"
        in rows[slow.kernel_id].detail
    )
    assert (
        rows[fast.kernel_id].outcome == "kept"
        and "60.0 us against the default's 100.0" in rows[fast.kernel_id].detail
    )


def test_an_entry_whose_buckets_hold_no_timing_shape_says_it_was_not_timed(tmp_path: Path) -> None:
    """An entry registered under a bucket the op no longer produces (the package library's first
    entry served "d128" before buckets said the bag regime) cannot be timed: verify says so,
    instead of calling it correct and nothing more."""
    library = KernelLibrary(tmp_path / "lib")
    old = library.add(
        op=OP, entry=TEMPLATE.entry, source=TEMPLATE.render({"BLOCK_L": 8}) + "# old\n", arch="sm_90",
        dtype="fp32", buckets=["d128"], median_us=50.0, interpreted=False, evidence={}, provenance={},
    )  # fmt: skip
    backend = _GpuTimes({"# old": 40.0, "def embedding_bag_forward": 100.0})
    [row] = verify_library(library, backend, "sm_90")[0]
    assert row.outcome == "kept" and row.entry.kernel_id == old.kernel_id
    assert row.detail == (
        "correct; not timed: none of embedding_bag's fp32 timing shapes falls in its buckets (d128), "
        "so dispatch may never choose it"
    )


def test_an_entry_another_entry_now_beats_is_demoted_and_times_are_written_back(
    tmp_path: Path, monkeypatch
) -> None:
    """Two entries of one key: re-timed, the one dispatch ran is now the slower, beyond the noise,
    on every bucket it serves; it is demoted, the other's new time is recorded, and the command
    shows what dispatch runs now."""
    library = KernelLibrary(tmp_path / "lib")
    was_fast = _add(library, TEMPLATE.render({"BLOCK_L": 8}) + "# was fast\n", arch="sm_90", median_us=50.0)
    was_slow = _add(library, TEMPLATE.render({"BLOCK_L": 16}) + "# was slow\n", arch="sm_90", median_us=70.0)
    assert library.best(OP, "sm_90", "fp32", "d64-long") == was_fast
    backend = _GpuTimes({"# was fast": 90.0, "# was slow": 60.0, "def embedding_bag_forward": 100.0})
    monkeypatch.setattr("sandbox.local.LocalBackend", lambda **_: backend)
    monkeypatch.setattr("agent.incumbents.campaign_arch", lambda: "sm_90")
    listed = CliRunner().invoke(
        app, ["library", "verify", "--library", str(library.root)], terminal_width=200
    )
    assert listed.exit_code == 0, listed.output
    fresh = KernelLibrary(library.root)
    [demoted] = [e for e in fresh.entries() if e.demoted]
    assert demoted.kernel_id == was_fast.kernel_id
    assert demoted.demoted == f"another entry is faster on every bucket it serves ({was_slow.kernel_id})"
    now = fresh.best(OP, "sm_90", "fp32", "d64-long")
    assert now.kernel_id == was_slow.kernel_id and now.median_us == pytest.approx(60.0)
    assert now.bucket_us == {"d64-long": pytest.approx(60.0)}
    assert "what changed" in listed.output and "2 entries, 1 demoted now" in listed.output
    changed = listed.output.split("what changed")[1]
    assert "d64-long" in changed and was_fast.kernel_id[-8:] in changed and was_slow.kernel_id[-8:] in changed


def test_an_entry_built_on_another_kit_is_refused_until_verified_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry whose source imports the kit records the kit's hash; once the kit changes,
    dispatch refuses it with the reason, `library list` shows it, and `library verify` checks
    it with the new kit and dispatches it again."""
    from kernels import kit

    library = KernelLibrary(tmp_path / "lib")
    source = TEMPLATE.render({"BLOCK_L": 8}) + "\nfrom kernels.kit.attention import LOG2E\n"
    entry = _add(library, source)
    assert entry.kit_hash == kit.kit_hash()
    assert library.best(OP, "interpreter", "fp32", "d64-long") == entry
    monkeypatch.setattr(kit, "kit_hash", lambda: "f" * 16)  # this checkout's kit, changed since
    fresh = KernelLibrary(library.root)
    with pytest.warns(UserWarning, match=f"{entry.kernel_id} refused: built against kit {entry.kit_hash}"):
        assert fresh.best(OP, "interpreter", "fp32", "d64-long") is None
    listed = CliRunner().invoke(app, ["library", "list", "--library", str(library.root)])
    why = f"refused: {entry.kernel_id} (fp32, interpreter): built against kit"
    assert why in listed.output, listed.output
    [row], _ = verify_library(fresh, QuickBackend(), "interpreter")
    assert row.outcome == "kept", row.detail
    again = KernelLibrary(library.root)
    assert again.entries()[0].kit_hash == "f" * 16
    assert again.best(OP, "interpreter", "fp32", "d64-long") == again.entries()[0]
