"""A new op is its own files: the test suite declares seq_scaled_sum (tests/ops/seq_scaled_sum.py
and its kernel) through the op API alone, names its module in RECFORGE_OPS, and every part of
recforge finds it: the sandbox checks and times its kernel, a short campaign searches its knobs
and registers the winner, dispatch runs that winner (forward and backward through the custom
op), the op benchmark times it beside the reference, and the library lists it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OP = "seq_scaled_sum"


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """RECFORGE_OPS names the op's module, importable here and in the judge's process."""
    monkeypatch.setenv("RECFORGE_OPS", OP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(HERE))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )


def test_the_op_is_found_by_name_and_its_custom_op_checks_out(plugin) -> None:
    from kernels import ops
    from search_space import get_problem, problem_names
    from search_space.template import get_template

    assert OP in problem_names() and get_problem(OP).name == OP
    assert get_template(OP).render({"BLOCK_L": 8}).count('"BLOCK_L": 8') == 1
    fn = ops.op(OP)
    x = torch.randn(12, 24, requires_grad=True)
    offsets = torch.tensor([0, 5, 5, 12])
    torch.library.opcheck(fn.custom_op, (x.detach(), offsets, 0.5))
    # Its backward through the custom op (the eager path is a torch.autograd.Function) and
    # through the eager path agree with the reference's.
    grad_out = torch.randn(3, 24)
    reference = get_problem(OP).reference
    (expected,) = torch.autograd.grad(reference(x, offsets, scale=0.25), x, grad_out)
    for call in (lambda t: fn.custom_op(t, offsets, 0.25), lambda t: fn(t, offsets, scale=0.25)):
        (got,) = torch.autograd.grad(call(x), x, grad_out)
        torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="contiguous"):
        fn(x.detach().t(), offsets)


@pytest.mark.slow
def test_the_sandbox_checks_a_campaign_registers_dispatch_runs_and_the_benchmark_times_it(
    plugin, tmp_path: Path, empty_library
) -> None:
    from evals.bench_ops import run_op_benchmark
    from kernels import DISPATCHER, ops

    # The sandbox, through the CLI: the default kernel is checked on fresh inputs (the campaign
    # below times it).
    done = _cli(
        plugin,
        "sandbox",
        "eval",
        "--problem",
        OP,
        "--source",
        str(HERE / "seq_scaled_sum_kernel.py"),
        "--no-timing",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "ok", result["message"]
    assert {c["dtype"] for c in result["checks"]} == {"fp32", "bf16"}

    # A short knob search: the incumbent (its default kernel) and one proposal.
    library = tmp_path / "library"
    config = tmp_path / "campaign.toml"
    config.write_text(
        textwrap.dedent(f"""
        name = "plugin"
        problems = ["{OP}"]
        output_dir = "{tmp_path / "out"}"
        library = "{library}"
        [proposer]
        kinds = ["search"]
        batch_size = 1
        seed = 1
        [budget]
        max_evaluations = 2
        max_wall_s = 600
        [sandbox]
        timeout_s = 120
        trials = 2
    """)
    )
    env = {**plugin, "RECFORGE_HOME": str(tmp_path / "home"), "COLUMNS": "250"}
    done = _cli(env, "campaign", "run", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    listed = _cli(env, "library", "list", "--library", str(library))
    assert listed.returncode == 0 and OP in listed.stdout, listed.stdout + listed.stderr

    # Dispatch runs the registered kernel, forward and backward.
    DISPATCHER.use_library(library)
    [entry] = [e for e in DISPATCHER.library.entries() if e.op == OP]
    x = torch.randn(30, 24, requires_grad=True)
    offsets = torch.tensor([0, 4, 4, 30])
    out = ops.op(OP)(x, offsets, scale=2.0)
    assert DISPATCHER.last[OP] == f"library:{entry.kernel_id}"
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))

    # The op benchmark: the registered kernel beside the default and the baselines, all correct.
    rows = run_op_benchmark(OP, library=library)
    providers = {r["provider"] for r in rows}
    assert {"default kernel", "best registered", "reference"} <= providers, providers
    assert all(r["correct"] for r in rows)
