"""The rt6 cases of tests/sandbox/adversarial beyond the screen: the timing audit's own defence.

Each `adversarial/rt6_*.py` case is refused by the screen (its `# expect:`, which
test_adversarial.py checks on every machine). What it attacks lies behind the screen: the
runner's L2 flush (sandbox.flush, "best effort in that process") and the judge's audit of each
timed batch (sandbox.judge.Calibration.audit), which are the defence against a candidate that
gets past the screen. Here each case is evaluated as the local backend evaluates a screened
candidate (LocalBackend._evaluate_on: the same judge, runner sandbox and timing), only without
the screen, so that what the runner and the audit catch on their own shows.

Headers read here, beside those test_adversarial.py reads: `# unscreened-gpu: STATUS | FRAGMENT`
(alternatives of the fragment separated by `||`), what the case gets unscreened on a GPU;
`# hole: WHAT`, a case the sandbox behind the screen accepts today although it must not: run
with RECFORGE_RUN_HOLES=1 on a GPU, each is expected to fail (strict xfail) until the hole it
names is closed, as in test_adversarial_updates.py. In the interpreter no flush runs and no
audit is made (no calibration on a CPU), so there every case must merely compute the op
correctly (ok): that shows the screen is all that refuses it there, and that its kernels are
right, so a GPU's `ok` is the audit's miss, not a lucky check.

`python tests/sandbox/test_adversarial_unscreened.py [CASE ...]` evaluates the
control (control_correct.py) and the cases unscreened, timed, and prints each timing shape's
median against the control's, and the share of the judge's clock the events and calibrated
flushes account for (ShapeTiming.accounted); with $OUT set, the results as JSON there too.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from case_headers import header as _header
from case_headers import open_holes_only

from sandbox import Candidate, EvalResult, LocalBackend, Status, isolation

ADVERSARIAL = Path(__file__).resolve().parent / "adversarial"
CASES = sorted(ADVERSARIAL.glob("rt6_*.py"))
PROBLEM = "embedding_bag"


HOLES = [p for p in CASES if _header(p.read_text(), "hole", "") != ""]
REFUSED = [p for p in CASES if _header(p.read_text(), "unscreened-gpu", "") != ""]


def _source(path: Path) -> str:
    text = path.read_text()
    if _header(text, "base", "no") == "yes":
        return (ADVERSARIAL / "base.py").read_text() + "\n\n" + text
    return text


def evaluate_unscreened(path: Path, scratch_root: Path, *, timing: bool = True) -> EvalResult:
    """`path`'s candidate evaluated as LocalBackend.evaluate would, less the screen."""
    backend = LocalBackend(timeout_s=900, scratch_root=scratch_root)
    candidate = Candidate(problem=PROBLEM, source=_source(path), entry=PROBLEM)
    with backend.places.use() as place:
        return backend._evaluate_on(
            place,
            candidate,
            check=True,
            timing=timing,
            baselines=[],
            baselines_held_on=[],
            baselines_claims=None,
            trials=2,
        )


sandboxed = pytest.mark.skipif(
    isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}"
)


def test_every_case_says_what_it_tries_and_gets() -> None:
    assert len(CASES) >= 2
    for path in CASES:
        text = path.read_text()
        assert text.startswith('"""'), f"{path.name} has no docstring saying what it tries"
        assert _header(text, "expect").startswith("static_rejected"), f"{path.name}: the screen refuses it"
        assert (path in HOLES) != (path in REFUSED), f"{path.name}: a hole or refused unscreened, one of them"


@pytest.mark.slow
@sandboxed
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run: no flush, no audit")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_unscreened_case_computes_the_op_in_the_interpreter(path: Path, tmp_path: Path) -> None:
    result = evaluate_unscreened(path, tmp_path / "scratch")
    assert result.status == Status.OK, (
        f"{path.name}: {result.status.value}: {result.message}\n{result.log_tail}"
    )


@pytest.mark.slow
@sandboxed
@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", REFUSED, ids=[p.stem for p in REFUSED])
def test_unscreened_case_is_refused_on_a_gpu(path: Path, tmp_path: Path) -> None:
    status, _, fragment = _header(path.read_text(), "unscreened-gpu").partition("|")
    result = evaluate_unscreened(path, tmp_path / "scratch")
    assert result.status == Status(status.strip()), f"{path.name}: {result.status.value}: {result.message}"
    assert any(f.strip() in result.message for f in fragment.split("||")), result.message


@pytest.mark.slow
@sandboxed
@pytest.mark.gpu
@pytest.mark.timeout(900)
@open_holes_only
@pytest.mark.xfail(strict=True, reason="an open hole of the sandbox behind the screen: the case is accepted")
@pytest.mark.parametrize("path", HOLES, ids=[p.stem for p in HOLES])
def test_open_hole_is_refused(path: Path, tmp_path: Path) -> None:
    result = evaluate_unscreened(path, tmp_path / "scratch")
    assert result.status != Status.OK, f"{path.name} is accepted: {_header(path.read_text(), 'hole')}"


def _summary(result: EvalResult) -> dict:
    return {
        "status": result.status.value,
        "message": result.message[:400],
        "timings": {
            f"{t.shape}/{t.dtype}": {
                "median_us": t.candidate.median_us,
                "p20_us": t.candidate.p20_us,
                "p80_us": t.candidate.p80_us,
                "outside_us": t.outside_us,
                "accounted": t.accounted,
            }
            for t in result.timings
        },
    }


def main(names: list[str]) -> int:
    """The control and the cases named (all rt6 cases by default), unscreened and timed."""
    paths = [ADVERSARIAL / "control_correct.py"]
    paths += [p for p in CASES if not names or p.stem in names]
    results = {}
    with tempfile.TemporaryDirectory(prefix="rt6-") as tmp:
        for path in paths:
            result = evaluate_unscreened(path, Path(tmp) / path.stem)
            results[path.stem] = _summary(result)
            print(f"== {path.stem}: {result.status.value} {result.message[:300]}", flush=True)
    control = results["control_correct"]["timings"]
    for name, summary in results.items():
        for shape, t in summary["timings"].items():
            base = control.get(shape, {}).get("median_us")
            ratio = f"{t['median_us'] / base:.2f}x the control" if base else ""
            accounted = "-" if t["accounted"] is None else f"{t['accounted']:.2f}"
            outside = "-" if t["outside_us"] is None else f"{t['outside_us']:.1f}"
            print(f"{name:38s} {shape:32s} median {t['median_us']:9.1f} us  {ratio:18s} "
                  f"clock/call {outside:>8s} us  accounted {accounted}")  # fmt: skip
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "rt6_unscreened.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
