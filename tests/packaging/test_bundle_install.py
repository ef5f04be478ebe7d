"""A training job reuses a campaign's winners: a fresh virtual environment holding only torch,
triton and `recforge[worker]` installs an exported bundle with `python -m kernels.bundle install`
and runs the model's training step, which dispatches the bundle's kernels (forward and backward).

The environment is a new venv whose site-packages holds exactly the distributions of
recforge's base requirements and what they require in turn (linked from this environment, so
no index is needed), plus recforge itself installed from a wheel built from this checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from kernels import bundle
from kernels.registry import ARCH_INTERPRETER, KernelLibrary
from search_space import embedding_bags as eb_problem
from search_space import embedding_bags_update as update_problem

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DIMS = (16, 32)  # the training script's table dims: the bundle's entries serve both regimes of each
BUCKETS = sorted({eb_problem.bucket_of(d, ids) for d in DIMS for ids in (1, 20)})
# The step's one fused update, over every table: its widest dim.
UPDATE_BUCKETS = sorted({update_problem.bucket_of(max(DIMS), ids, "adagrad") for ids in (1, 20)})
AGENT = ["typer", "rich", "optuna", "langgraph", "ray", "docker", "openai", "tenacity", "matplotlib", "agent"]

TRAIN = """
import importlib.metadata, json, sys
import torch
import kernels.ops  # noqa: F401
from kernels.registry import DISPATCHER, PACKAGE_LIBRARY
from model.config import config_from_dict
from model.data import TrafficGenerator
from model.gem import GEMModel

config = config_from_dict({
    "name": "bundle",
    "tables": [{"name": "users", "num_rows": 200, "dim": 16}, {"name": "items", "num_rows": 300, "dim": 32}],
    "features": [
        {"name": "user_id", "table": "users", "side": "user"},
        {"name": "item_id", "table": "items"},
        {"name": "item_tags", "table": "items", "max_bag": 24},
    ],
    "interaction": {"dim": 16, "num_layers": 1, "fm_rank": 4, "fm_outputs": 2, "compressed_outputs": 2,
                    "mlp_dims": [16]},
    "heads": {"mlp_dims": [16]},
    "data": {"num_dense": 4},
})
torch.manual_seed(0)
model = GEMModel(config)
batch = TrafficGenerator(config, seed=1).batch(0, num_requests=3, candidates_per_request=4)
loss, _ = model.loss(batch)
loss.backward()
torch.optim.SGD(model.dense_parameters(), lr=0.1).step()  # the tables were stepped in the backward
print(json.dumps({
    "loss": loss.item(),
    "calls": sorted([op, impl, n] for (op, impl), n in DISPATCHER.calls.items()),
    "library": str(DISPATCHER.library.root), "package_library": str(PACKAGE_LIBRARY),
    "distributions": sorted({d.metadata["Name"].lower() for d in importlib.metadata.distributions()}),
    "agent_modules": sorted(m for m in sys.modules if m.split(".")[0] in AGENT),
    "recforge_from": __import__("kernels").__file__,
}))
"""


def _closure(roots: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions that `roots` require, transitively (markers evaluated here,
    no extras)."""
    env = default_environment()
    found: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        req = Requirement(todo.pop())
        name = req.name.lower().replace("_", "-")
        if name in found or (req.marker is not None and not req.marker.evaluate({**env, "extra": ""})):
            continue
        try:
            found[name] = dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # an optional or platform requirement absent here: absent there too
        todo += dist.requires or []
    return found


def _link_distributions(dists: dict[str, metadata.Distribution], site: Path) -> None:
    """Each distribution's top-level files and folders (its RECORD's), linked into `site`."""
    for dist in dists.values():
        tops = {Path(str(f)).parts[0] for f in dist.files or []} - {".."}
        for top in tops:
            target = Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)


@pytest.fixture(scope="module")
def worker_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("worker-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True)
    python = tmp / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    base = metadata.distribution("recforge").requires or []
    _link_distributions(_closure([r for r in base if "extra ==" not in r]), Path(purelib))
    # recforge from a wheel of this checkout (copied first: building writes beside the sources).
    src = tmp / "src"
    shutil.copytree(
        ROOT, src,
        ignore=shutil.ignore_patterns(".git", ".venv", ".tools", ".whl", "build", "*.egg-info", "__pycache__",
                                      "runs", ".recforge", "tests", "campaigns", "data"),
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp / "w"), "."],
        cwd=src, check=True, capture_output=True,
    )  # fmt: skip
    wheel = next((tmp / "w").glob("recforge-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
         f"recforge[worker] @ {wheel.as_uri()}"],
        check=True, capture_output=True,
    )  # fmt: skip
    assert sysconfig.get_paths()["purelib"] != purelib
    return python


def _bundle(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A bundle of the table-batched lookup and its fused training update for the interpreter:
    not the defaults' tiles, so that dispatching them is visibly the bundle's doing."""
    lib = KernelLibrary(tmp_path / "campaign-library")
    ids = {}
    for op, template, knobs, buckets in (
        ("embedding_bags", eb_problem.TEMPLATE, {"BLOCK_D": 16, "BLOCK_L": 8, "BLOCK_B": 2}, BUCKETS),
        ("embedding_bags_update", update_problem.TEMPLATE, {"CHUNK": 32, "BLOCK_I": 4}, UPDATE_BUCKETS),
    ):
        added = lib.add(
            op=op, entry=template.entry, source=template.render(knobs), arch=ARCH_INTERPRETER,
            dtype="fp32", buckets=buckets, median_us=None, interpreted=True, evidence={},
            provenance={"test": "bundle_install"},
        )  # fmt: skip
        ids[op] = added.kernel_id
    bundle.export(lib.root, tmp_path / "winners.tar.gz")
    return tmp_path / "winners.tar.gz", ids


def test_a_fresh_worker_environment_installs_a_bundle_and_trains_with_its_kernels(
    worker_venv: Path, tmp_path: Path
) -> None:
    path, ids = _bundle(tmp_path)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TRITON_INTERPRET": "1"}
    # Installed into the environment's own package library: dispatch reads it with no setting.
    done = subprocess.run(
        [worker_venv, "-m", "kernels.bundle", "install", str(path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "installed 2 kernels" in done.stdout
    done = subprocess.run(
        [worker_venv, "-c", f"AGENT = {AGENT!r}\n" + TRAIN],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    # The environment: recforge from the wheel, nothing of the agent's installed or imported.
    assert str(worker_venv.parent.parent) in report["recforge_from"]
    assert report["library"] == report["package_library"]
    assert "recforge" in report["distributions"] and {"torch", "triton"} <= set(report["distributions"])
    assert not {"typer", "rich", "optuna", "langgraph", "ray", "docker", "openai"} & set(
        report["distributions"]
    )
    assert report["agent_modules"] == []
    # The training step ran the bundle's kernels: the lookups (one per side: the user's
    # features, then the candidate's) and the tables' one fused update in the backward; and the
    # default kernel of the op the bundle holds nothing for (the Wukong layer's block).
    calls = {(op, impl): n for op, impl, n in report["calls"]}
    assert calls == {
        ("embedding_bags", f"library:{ids['embedding_bags']}"): 2,
        ("embedding_bags_update", f"library:{ids['embedding_bags_update']}"): 1,
        ("wukong_fm", "default"): 1,
    }, report["calls"]
    assert 0 < report["loss"] < float("inf")


def test_without_the_bundle_the_same_step_runs_the_defaults(worker_venv: Path, tmp_path: Path) -> None:
    """The control: with an empty library in its place, the same step runs the default kernels,
    so the calls above are the bundle's doing."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TRITON_INTERPRET": "1",
           "RECFORGE_LIBRARY": str(tmp_path / "empty")}  # fmt: skip
    done = subprocess.run(
        [worker_venv, "-c", f"AGENT = {AGENT!r}\n" + TRAIN],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    calls = {(op, impl) for op, impl, _ in json.loads(done.stdout.strip().splitlines()[-1])["calls"]}
    assert calls == {
        ("embedding_bags", "default"),
        ("embedding_bags_update", "default"),
        ("wukong_fm", "default"),
    }
