"""The kernel library and the dispatcher's fallback chain: library kernel, else the hand-written
default, else the PyTorch reference where Triton cannot run."""

import json
from pathlib import Path

import pytest
import torch

from kernels import ops
from kernels.embedding_bag import embedding_bag_forward
from kernels.registry import (
    ARCH_INTERPRETER,
    DISPATCHER,
    KernelLibrary,
    LibraryEntry,
    device_arch,
)
from search_space.embedding_bag import TEMPLATE, reference

OP = "embedding_bag"
CPU = torch.device("cpu")


def _add(
    library: KernelLibrary,
    source: str,
    *,
    dtype: str = "fp32",
    buckets=("d64",),
    median_us: float | None = 10.0,
    arch: str = ARCH_INTERPRETER,
) -> LibraryEntry:
    return library.add(
        op=OP,
        entry=TEMPLATE.entry,
        source=source,
        arch=arch,
        dtype=dtype,
        buckets=list(buckets),
        median_us=median_us,
        interpreted=True,
        evidence={"checks": 20},
        provenance={"origin": "template"},
    )


def _resolve(dtype: str = "fp32", bucket: str = "d64", device: torch.device = CPU) -> str:
    return DISPATCHER.resolve(OP, device=device, dtype=dtype, bucket=bucket).name


# --- fallback chain -------------------------------------------------------------------------


def test_empty_library_gives_default_under_interpreter(
    empty_library, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    impl = DISPATCHER.resolve(OP, device=CPU, dtype="fp32", bucket="d64")
    assert impl.name == "default"
    assert impl.fn is embedding_bag_forward


def test_no_triton_gives_reference(empty_library, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    impl = DISPATCHER.resolve(OP, device=CPU, dtype="fp32", bucket="d64")
    assert impl.name == "reference"
    assert impl.fn is reference


def test_no_triton_ignores_the_library(empty_library, monkeypatch: pytest.MonkeyPatch) -> None:
    _add(empty_library, TEMPLATE.render({}))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _resolve() == "reference"


def test_references_only_names_ops_and_takes_their_gradients_along(
    empty_library, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def names(*ops: str) -> list[str]:
        return [DISPATCHER.resolve(op, device=CPU, dtype="fp32", bucket="d64").name for op in ops]

    both = ("jagged_attention", "jagged_attention_grad", "embedding_bag")
    with DISPATCHER.references_only("jagged_attention"):
        assert names(*both) == ["reference", "reference", "default"]
        with DISPATCHER.references_only():
            assert names(*both) == ["reference"] * 3
        assert names(*both) == ["reference", "reference", "default"]
    assert names(*both) == ["default"] * 3
    with pytest.raises(KeyError, match="no op named jaged_attention"):
        DISPATCHER.references_only("jaged_attention").__enter__()


def test_library_kernel_for_matching_key_else_default(empty_library, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    added = _add(empty_library, TEMPLATE.render({"BLOCK_D": 32}), buckets=["d64", "d128"])
    assert added.kernel_id.startswith(f"{OP}_")
    assert _resolve("fp32", "d64") == f"library:{added.kernel_id}"
    assert _resolve("fp32", "d128") == f"library:{added.kernel_id}"
    assert _resolve("fp32", "d256") == "default"  # other bucket
    assert _resolve("bf16", "d64") == "default"  # other dtype


def test_library_kernel_for_another_arch_is_not_used(empty_library, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _add(empty_library, TEMPLATE.render({}), arch="sm_90")
    assert _resolve() == "default"


def test_op_runs_the_library_kernel(empty_library, device: torch.device) -> None:
    """End to end: the op dispatches to the stored module, which computes the right thing."""
    added = _add(empty_library, TEMPLATE.render({"BLOCK_L": 16, "ACC_3D": True}), arch=device_arch(device))
    weight = torch.randn(40, 64, device=device)
    indices = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], device=device)
    offsets = torch.tensor([0, 1, 1, 20], device=device)
    out = ops.embedding_bag(weight, indices, offsets)
    assert DISPATCHER.last[OP] == f"library:{added.kernel_id}"
    torch.testing.assert_close(out, reference(weight.double(), indices, offsets).float())


def test_an_edited_source_is_refused_and_dispatch_falls_back_down_the_chain(
    empty_library, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An entry's source must be what was verified: one edited afterwards (here, to return the
    output doubled) is passed over for the next entry, then the default, with a warning naming
    it; `recforge library list` says why."""
    from typer.testing import CliRunner

    from agent.cli import app

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fast = _add(empty_library, TEMPLATE.render({"BLOCK_D": 32}), median_us=5.0)
    slow = _add(empty_library, TEMPLATE.render({"BLOCK_D": 64}), median_us=9.0)
    assert _resolve() == f"library:{fast.kernel_id}"
    for entry in (fast, slow):
        path = empty_library.root / entry.source_file
        path.write_text(path.read_text().replace("    return out\n", "    return out * 2\n"))
        assert path.read_text() != TEMPLATE.render({})
    fresh = DISPATCHER.use_library(empty_library.root)  # a new process's view
    with pytest.warns(UserWarning, match=f"{fast.kernel_id} refused: its source .* edited since"):
        assert _resolve() == "default"
    assert fresh.refusal(slow) is not None
    with pytest.raises(ValueError, match="was edited since it was verified"):
        fresh.load(fast)
    listed = CliRunner().invoke(app, ["library", "list", "--library", str(empty_library.root)])
    assert listed.exit_code == 0, listed.output
    assert f"refused: {fast.kernel_id} (fp32, interpreter): its source" in listed.output, listed.output


# --- the library itself ---------------------------------------------------------------------


def test_best_picks_lowest_median(tmp_path: Path) -> None:
    library = KernelLibrary(tmp_path)
    untimed = _add(library, TEMPLATE.render({"BLOCK_L": 4, "BLOCK_D": 32}), median_us=None)
    slow = _add(library, TEMPLATE.render({"BLOCK_L": 16}), median_us=9.0)
    fast = _add(library, TEMPLATE.render({"BLOCK_L": 32}), median_us=2.5)
    other_bucket = _add(library, TEMPLATE.render({"BLOCK_L": 4}), median_us=1.0, buckets=["d16"])
    assert len({e.kernel_id for e in (untimed, slow, fast, other_bucket)}) == 4
    assert library.best(OP, ARCH_INTERPRETER, "fp32", "d64") == fast
    assert library.best(OP, ARCH_INTERPRETER, "fp32", "d16") == other_bucket
    assert library.best(OP, ARCH_INTERPRETER, "bf16", "d64") is None
    assert library.best(OP, "sm_90", "fp32", "d64") is None


def test_best_ranks_untimed_after_timed(tmp_path: Path) -> None:
    library = KernelLibrary(tmp_path)
    _add(library, TEMPLATE.render({"BLOCK_L": 4, "BLOCK_D": 32}), median_us=None)
    timed = _add(library, TEMPLATE.render({"BLOCK_L": 16}), median_us=500.0)
    assert library.best(OP, ARCH_INTERPRETER, "fp32", "d64") == timed


def test_manifest_round_trips(tmp_path: Path) -> None:
    source = TEMPLATE.render({})
    first = _add(KernelLibrary(tmp_path), source, buckets=["d64", "d128"])
    second = _add(KernelLibrary(tmp_path), source, dtype="bf16", median_us=3.0)
    reopened = KernelLibrary(tmp_path)
    assert reopened.entries() == [first, second]
    assert (tmp_path / first.source_file).read_text() == source
    assert json.loads(reopened.manifest_path.read_text())["version"] == 1
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temp files


def test_re_adding_replaces_the_entry(tmp_path: Path) -> None:
    library = KernelLibrary(tmp_path)
    source = TEMPLATE.render({})
    _add(library, source, median_us=9.0)
    again = _add(library, source, median_us=4.0)
    assert library.entries() == [again]


def test_manifest_is_parsed_again_only_when_it_changes(tmp_path: Path, monkeypatch) -> None:
    """Dispatch asks for the entries on every op call: an unchanged manifest is not parsed
    again, and a kernel another process (another library object) registers is seen at once."""
    import kernels.registry as registry

    source = TEMPLATE.render({})
    reader = KernelLibrary(tmp_path)
    first = _add(KernelLibrary(tmp_path), source)
    parses = []
    real_loads = registry.json.loads
    monkeypatch.setattr(registry.json, "loads", lambda text: parses.append(1) or real_loads(text))
    assert reader.entries() == [first]
    assert reader.entries() == [first]
    assert len(parses) == 1
    second = _add(KernelLibrary(tmp_path), source, dtype="bf16")
    assert reader.entries() == [first, second]
    assert len(parses) == 3  # the writer read it once to add, the reader once after the change


def test_missing_manifest_is_an_empty_library(tmp_path: Path) -> None:
    assert KernelLibrary(tmp_path / "nowhere").entries() == []


@pytest.mark.parametrize(
    "text",
    ["{not json", '{"version": 1}', '{"kernels": [{"kernel_id": "x"}]}', '{"kernels": 3}'],
    ids=["not-json", "no-kernels", "missing-fields", "kernels-not-a-list"],
)
def test_corrupt_manifest_names_the_file(tmp_path: Path, text: str) -> None:
    library = KernelLibrary(tmp_path)
    library.manifest_path.write_text(text)
    with pytest.raises(ValueError, match="manifest.json"):
        library.entries()


@pytest.mark.gpu
def test_gpu_dispatch_uses_entries_of_its_own_arch_only(empty_library) -> None:
    cuda = torch.device("cuda")
    _add(empty_library, TEMPLATE.render({"BLOCK_L": 16}), arch=ARCH_INTERPRETER, median_us=1.0)
    assert _resolve(device=cuda) == "default"  # interpreted timings say nothing about a GPU
    added = _add(empty_library, TEMPLATE.render({}), arch=device_arch(cuda), median_us=50.0)
    assert _resolve(device=cuda) == f"library:{added.kernel_id}"


def test_the_dispatch_benchmark_measures_both_choices_and_restores_the_library() -> None:
    from evals.bench_dispatch import run_dispatch_benchmark

    before = DISPATCHER.library
    result = run_dispatch_benchmark(calls=200, repeats=1)
    assert DISPATCHER.library is before
    assert set(result["rows"]) == {"library entry", "default kernel"}
    assert all(row["us_per_call"] > 0 for row in result["rows"].values())


def test_the_dispatch_benchmark_times_each_ops_bucket_and_choice() -> None:
    """Every declared op gets a row: the bucket its first check shape falls in, the same as the
    problem computes for that shape (one bucket function for problem and dispatch), and the host
    time of the bucket alone and with the choice."""
    from evals.bench_dispatch import run_op_dispatch_benchmark
    from search_space import get_problem, problem_names

    result = run_op_dispatch_benchmark(calls=20, repeats=1)
    assert {"embedding_bag", "jagged_attention", "jagged_attention_grad", "dense_to_jagged"} <= set(
        result["rows"]
    )
    for name, row in result["rows"].items():
        problem = get_problem(name)
        assert row["bucket"] == problem.bucket(problem.check_shapes[0]), name
        assert row["bucket_us"] > 0 and row["total_us"] > 0, (name, row)
    assert set(result["rows"]) <= set(problem_names())


def test_triton_reads_the_verified_text_not_the_file(empty_library, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module runs the text that was hashed, and source inspection (Triton's way to its
    kernels) sees that same text, even where the file changes after the check."""
    import inspect

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    added = _add(empty_library, TEMPLATE.render({"BLOCK_D": 32}))
    path = empty_library.root / added.source_file
    text = path.read_text()
    fn = empty_library.load(added)
    path.write_text(text.replace("return out", "return out * 2"))
    assert "return out * 2" not in inspect.getsource(fn)
    assert inspect.getsource(fn) in text


def test_a_source_edited_after_its_check_is_refused_at_load_and_dispatch_moves_on(
    empty_library, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    added = _add(empty_library, TEMPLATE.render({"BLOCK_D": 32}))
    assert empty_library.refusal(added) is None  # checked (by `library list`, say), not loaded
    path = empty_library.root / added.source_file
    path.write_text(path.read_text().replace("return out", "return out * 2"))
    with pytest.warns(UserWarning, match="was edited since it was verified"):
        assert _resolve() == "default"
    assert _resolve() == "default"


@pytest.mark.slow
def test_dispatch_sees_a_write_of_this_process_at_once_and_another_processes_soon(
    empty_library, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dispatch caches its choice per key and looks at the manifest at most every RECHECK_S
    seconds; a write through any library object of this process is seen by the next call."""
    import subprocess
    import sys
    import time

    from kernels import registry

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _resolve() == "default"
    other = KernelLibrary(empty_library.root)  # the same folder, another object (a campaign's)
    added = _add(other, TEMPLATE.render({"BLOCK_L": 16}), median_us=5.0)
    assert _resolve() == f"library:{added.kernel_id}"
    code = (
        "import sys; from kernels.registry import KernelLibrary, ARCH_INTERPRETER\n"
        "from search_space.embedding_bag import TEMPLATE\n"
        "KernelLibrary(sys.argv[1]).add(op='embedding_bag', entry=TEMPLATE.entry,\n"
        "    source=TEMPLATE.render({'BLOCK_L': 32}), arch=ARCH_INTERPRETER, dtype='fp32', buckets=['d64'],\n"
        "    median_us=1.0, interpreted=True, evidence={}, provenance={})\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code, str(empty_library.root)], check=True, cwd=root)
    time.sleep(registry.RECHECK_S * 2)
    fastest = min(empty_library.entries(), key=lambda e: e.median_us)
    assert fastest.median_us == 1.0 and _resolve() == f"library:{fastest.kernel_id}"


def test_times_rank_entries_only_among_those_measured_on_one_gpu_model(empty_library) -> None:
    """An sm_90 entry that won on an H200 (faster hardware, faster numbers) does not displace
    the H100's own winner on an H100; each GPU model gets its own first, then the rest."""
    entries = {}
    for gpu, us, block in (("NVIDIA H100 80GB HBM3", 80.0, 16), ("NVIDIA H200", 50.0, 32)):
        entries[gpu] = empty_library.add(
            op=OP, entry=TEMPLATE.entry, source=TEMPLATE.render({"BLOCK_L": block}), arch="sm_90",
            dtype="fp32", buckets=["d64"], median_us=us, interpreted=False,
            evidence={"device": {"name": gpu, "arch": "sm_90"}}, provenance={"origin": "template"},
        )  # fmt: skip
    best = {gpu: empty_library.best(OP, "sm_90", "fp32", "d64", gpu=gpu) for gpu in (*entries, "NVIDIA H800")}
    assert best["NVIDIA H100 80GB HBM3"] == entries["NVIDIA H100 80GB HBM3"]
    assert best["NVIDIA H200"] == entries["NVIDIA H200"]
    assert best["NVIDIA H800"] == entries["NVIDIA H200"]  # none of its own: the fastest of the rest
    assert entries["NVIDIA H200"].measured_on == "NVIDIA H200"
