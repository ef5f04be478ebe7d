"""The local backend on every GPU of a host: which GPUs a config names, which GPU each evaluation
gets (one evaluation at a time per GPU for timing, the GPU that frees first), each GPU's own
locks, the judge on its one GPU, and the kernels measured beside the first evaluation on a new
kind of device. Without GPUs, the places are GPU names given to the backend: the scheduling,
the requests and the locks are the real ones; only the judge is scripted, except in the tests
that run real judges (on this host's CPU, and on two GPUs where they exist)."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sandbox import gpus, isolation, local
from sandbox.backend import Alongside, AlongsideClaims
from sandbox.candidate import Candidate
from sandbox.gpus import Place, Places, check_gpus, gpu_place, select_gpus, split_cpus, visible_gpus
from sandbox.local import LocalBackend, WorkerBackend
from sandbox.locks import lock_path
from sandbox.protocol import EvalRequest
from sandbox.result import DeviceInfo, EvalResult, ShapeTiming, Status, TimingStats
from search_space.embedding_bag import TEMPLATE


def _candidate(block_l: int | None = 8, origin: str = "template", **knobs) -> Candidate:
    source = TEMPLATE.render({"BLOCK_L": block_l, **knobs})
    return Candidate(problem="embedding_bag", source=source, entry=TEMPLATE.entry, origin=origin)


# --- which GPUs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "visible", "chosen"),
    [
        (None, ["0", "1"], None),  # unset: the visible GPUs as one place, as before
        ("all", ["0", "1"], ["0", "1"]),
        ("all", [], None),  # a host without a GPU: nothing changes
        (1, ["0", "1"], ["0"]),
        ([1], ["0", "1"], ["1"]),
        ([1, 0], ["3", "5"], ["5", "3"]),  # indices into CUDA_VISIBLE_DEVICES' list, names from it
    ],
)
def test_a_config_names_gpus_of_the_host(spec, visible: list[str], chosen: list[str] | None) -> None:
    assert select_gpus(spec, visible) == chosen


@pytest.mark.parametrize(
    ("spec", "visible", "message"),
    [
        (0, ["0"], "gpus = 0: at least 1 GPU is needed"),
        ([], ["0"], "gpus = []: the list names no GPU"),
        ([0, 0], ["0", "1"], "gpus = [0, 0] names GPU 0 more than once"),
        ([-1], ["0"], "gpus = [-1]: GPU indices are whole numbers from 0"),
        (True, ["0"], 'gpus = True: give "all", a number of GPUs, or a list of GPU indices'),
        (3, ["0", "1"], "gpus = 3, but this host shows 2 GPU(s)"),
        ([0, 2], ["0", "1"], "gpus = [0, 2]: no GPU 2 here; this host shows 2 GPU(s)"),
        ([1], ["GPU-a1"], "gpus = [1]: no GPU 1 here; this host shows 1 GPU(s) (0 is GPU-a1)"),
        (1, [], "gpus = 1, but this host shows 0 GPU(s)"),
    ],
)
def test_gpus_a_host_does_not_have_are_named_in_the_error(spec, visible: list[str], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        select_gpus(spec, visible)
    assert str(caught.value) == message


def test_what_no_host_takes_is_refused_without_looking_at_one() -> None:
    check_gpus("all")
    check_gpus([0, 7])
    with pytest.raises(ValueError, match="at least 1 GPU"):
        check_gpus(0)


def test_visible_gpus_are_cuda_visible_devices_names_as_far_as_cuda_counts(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-8f2a,5")
    assert visible_gpus() == ["3", "GPU-8f2a"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == ["0", "1"]


def test_each_gpu_has_its_own_locks_named_by_its_uuid_where_known() -> None:
    zero, one = gpu_place("0"), gpu_place("1")
    assert zero.timing_locks == (lock_path("timing", "0"),)
    assert zero.timing_locks[0].name == "recforge-timing-0.lock"
    assert len({*zero.timing_locks, *zero.memory_locks, *one.timing_locks, *one.memory_locks}) == 4
    # A MIG id holds slashes: its lock is still one file in the temporary directory.
    assert lock_path("timing", "MIG-GPU-1/2/0").parent == zero.timing_locks[0].parent
    # Named by its UUID, a GPU's locks are the same files whatever index a campaign gives it.
    uuid = "GPU-8f2a0c1e-0000-1111-2222-333344445555"
    assert gpu_place("3", uuid=uuid).timing_locks == gpu_place("0", uuid=uuid).timing_locks


def test_the_host_as_one_place_takes_the_lock_of_every_gpu_it_sees(monkeypatch) -> None:
    """Two GPUs by UUID: the one-place mode holds both GPUs' locks, so its timing and that of a
    campaign with a place on either GPU never overlap."""
    uuids = ["GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"]
    monkeypatch.setattr(gpus, "gpu_uuids", lambda: uuids)
    host = gpus.host_place()
    assert host.gpu is None
    assert host.timing_locks == tuple(gpu_place(str(i), uuid=u).timing_locks[0] for i, u in enumerate(uuids))
    assert host.memory_locks == tuple(gpu_place(str(i), uuid=u).memory_locks[0] for i, u in enumerate(uuids))
    # Where the driver names no GPU, a lock named otherwise would keep nothing apart: refused.
    monkeypatch.setattr(gpus, "gpu_uuids", lambda: None)
    with pytest.raises(gpus.GpusUnknown, match="named by each GPU's UUID"):
        gpus.host_place()


def test_the_drivers_answer_is_kept_and_its_failure_asked_again(monkeypatch) -> None:
    answers = iter([None, ["GPU-a"]])
    asked: list[int] = []
    monkeypatch.setattr(gpus, "_KNOWN_UUIDS", {})
    monkeypatch.setattr(gpus, "_ask_uuids", lambda: asked.append(1) or next(answers))
    assert gpus.gpu_uuids() is None
    assert gpus.gpu_uuids() == ["GPU-a"] and gpus.gpu_uuids() == ["GPU-a"]
    assert len(asked) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # another view of the host's GPUs: asked anew
    monkeypatch.setattr(gpus, "_ask_uuids", lambda: ["GPU-b"])
    assert gpus.gpu_uuids() == ["GPU-b"]


def test_per_gpu_places_on_a_gpu_host_need_the_drivers_uuids(monkeypatch) -> None:
    monkeypatch.setattr(local, "cuda_present", lambda: True)
    monkeypatch.setattr(local, "visible_gpus", lambda: ["0", "1"])
    for answer in (None, ["GPU-a"]):  # none, or not one for each GPU torch counts
        monkeypatch.setattr(local, "gpu_uuids", lambda answer=answer: answer)
        with pytest.raises(gpus.GpusUnknown, match="of the 2 torch counts"):
            LocalBackend(timeout_s=60, isolation="none", gpus=["0"])


def test_per_gpu_places_take_the_uuids_the_driver_gives_in_cudas_order(monkeypatch) -> None:
    uuids = ["GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"]
    monkeypatch.setattr(local, "cuda_present", lambda: True)
    monkeypatch.setattr(local, "gpu_uuids", lambda: uuids)
    monkeypatch.setattr(local, "visible_gpus", lambda: ["5", "7"])
    backend = LocalBackend(timeout_s=60, isolation="none", gpus=["7"])
    [place] = backend.places.places
    assert place.gpu == "7" and place.timing_locks == (lock_path("timing", uuids[1]),)
    assert place.uuid == uuids[1]


def test_the_backend_probes_each_gpus_node_once_and_hands_it_to_the_judges(monkeypatch) -> None:
    """Under bubblewrap, the node of a place's GPU is probed by the backend once (not by every
    judge) and sent in each request; where the probe fails, or the GPU's node is unknown, the
    request carries none and the judge asks itself."""
    probes: list[int] = []

    def works(minor: int) -> bool:
        probes.append(minor)
        return minor != 9

    monkeypatch.setattr(isolation, "gpu_minor", lambda uuid: {"GPU-a": 4, "GPU-b": 9}.get(uuid))
    monkeypatch.setattr(isolation, "one_gpu_sandbox_works", functools.cache(works))
    backend = WorkerBackend()
    backend.isolation = "bwrap"
    a, b, unknown = (gpu_place(g, uuid=u) for g, u in (("0", "GPU-a"), ("1", "GPU-b"), ("2", "GPU-c")))
    assert [backend._gpu_node(p) for p in (a, a, b, b, unknown, gpu_place("3"))] == [
        4,
        4,
        None,
        None,
        None,
        None,
    ]
    assert probes == [4, 9]
    backend.isolation = "none"  # no sandbox: no node to restrict to
    assert backend._gpu_node(a) is None


def test_the_driver_is_asked_for_uuids_without_this_process_starting_cuda() -> None:
    """On this host: None without a CUDA driver, else one UUID per GPU torch counts, in the form
    nvidia-smi writes; torch's CUDA is not initialised by asking."""
    uuids = gpus._ask_uuids()
    if not torch.cuda.is_available():
        assert uuids is None
        return
    assert uuids is not None and len(uuids) == torch.cuda.device_count()
    assert all(u.startswith("GPU-") and len(u) == 40 for u in uuids)
    assert not torch.cuda.is_initialized()


# --- which GPU each evaluation gets -------------------------------------------------------------


def _places(n: int, per_place: int = 1) -> Places:
    return Places([gpu_place(str(i)) for i in range(n)], per_place)


def test_an_evaluation_goes_to_the_least_busy_gpu_and_among_idle_ones_to_the_first_freed() -> None:
    places = _places(2)
    with places.use() as a, places.use() as b:
        assert {a.gpu, b.gpu} == {"0", "1"}
    # GPU 1 freed first (the inner `use` ends first), so it takes the next evaluation.
    with places.use() as c:
        assert c.gpu == b.gpu
    two_each = _places(2, per_place=2)
    with two_each.use() as a, two_each.use() as b, two_each.use() as c:
        assert [a.gpu, b.gpu, c.gpu] == ["0", "1", "0"]  # spread before doubling up


def test_a_full_set_of_gpus_holds_the_next_evaluation_until_one_frees() -> None:
    places = _places(1)
    got: list[str | None] = []

    def take() -> None:
        with places.use() as place:
            got.append(place.gpu)

    with places.use():
        taker = threading.Thread(target=take)
        taker.start()
        taker.join(timeout=0.5)
        assert taker.is_alive() and got == []  # still waiting: GPU 0 is busy
    taker.join(timeout=30)
    assert got == ["0"]


class Scripted(WorkerBackend):
    """The backend's own scheduling, requests and locks around a scripted judge: `_run` records
    what each evaluation was given and answers as a judge on that GPU would, with the device
    kind `kinds` gives its GPU. `meet` evaluations wait for each other inside the judge, so that
    they provably run at once."""

    def __init__(self, tmp_path: Path, gpus: list[str], kinds: dict[str, DeviceInfo], meet: int = 1) -> None:
        self.scratch_root, self.keep_scratch = tmp_path / "scratch", False
        self._places = Places([gpu_place(g) for g in gpus], 1)
        self.kinds = kinds
        self.requests: list[EvalRequest] = []
        self.memory_held: list[bool] = []
        self.running: dict[str, int] = dict.fromkeys(gpus, 0)
        self.most_at_once: dict[str, int] = dict.fromkeys(gpus, 0)
        self._lock = threading.Lock()
        self._meet = threading.Barrier(meet)

    def _run(self, candidate, scratch, request):
        assert request.gpu is not None
        with self._lock:
            self.requests.append(request)
            self.running[request.gpu] += 1
            self.most_at_once[request.gpu] = max(self.most_at_once[request.gpu], self.running[request.gpu])
        # This evaluation holds its GPU's memory lock shared: nothing takes it alone meanwhile.
        with open(gpu_place(request.gpu).memory_locks[0], "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(lock, fcntl.LOCK_UN)
                held = False
            except BlockingIOError:
                held = True
        self._meet.wait(timeout=30)
        with self._lock:
            self.memory_held.append(held)
            self.running[request.gpu] -= 1
        stats = TimingStats(median_us=10.0, p20_us=10.0, p80_us=10.0, reps=5)
        timed = ShapeTiming(shape="s", dtype="fp32", bucket="d64", candidate=stats, flops=1.0, bytes=1.0,
                            achieved_gbps=1.0)  # fmt: skip
        return EvalResult(
            status=Status.OK,
            problem=candidate.problem,
            candidate_id=candidate.id,
            device=self.kinds[request.gpu],
            timings=[timed] if request.timing else [],
        )


def _device(name: str, arch: str) -> DeviceInfo:
    return DeviceInfo(name=name, arch=arch, torch="t", triton="t", python="p", interpreted=False)


H100, A100 = _device("NVIDIA H100", "sm_90"), _device("NVIDIA A100", "sm_80")


def test_evaluations_at_once_each_get_a_gpu_of_their_own_with_its_locks(tmp_path: Path) -> None:
    backend = Scripted(tmp_path, ["0", "1"], {"0": H100, "1": H100}, meet=2)
    candidates = [_candidate(n) for n in (4, 8, 16, 32)]
    results = backend.evaluate_many(candidates)
    assert [r.candidate_id for r in results] == [c.id for c in candidates]  # order kept
    # Two at a time (they met inside the judge), never two on one GPU, both GPUs used.
    assert backend.most_at_once == {"0": 1, "1": 1}
    assert {r.gpu for r in backend.requests} == {"0", "1"}
    for request in backend.requests:
        assert request.timing_locks == [str(lock_path("timing", request.gpu))]
    assert backend.memory_held == [True] * 4


def test_the_first_evaluation_on_a_new_kind_measures_the_kernels_beside_it_on_its_gpu(tmp_path: Path) -> None:
    """GPU 0 is a kind the caller measured its incumbents on, GPU 1 another: the first evaluation
    that lands on GPU 1 measures them there, on GPU 1, with its architecture's kernels; no other
    evaluation does."""
    backend = Scripted(tmp_path, ["0", "1"], {"0": H100, "1": A100})
    default, sm80 = _candidate(None, "library"), _candidate(4, "library", BLOCK_D=32)
    alongside = Alongside(held_on=[H100.kind], by_arch={"sm_80": [default, sm80]}, default=[default])
    results = backend.evaluate_many([_candidate(n) for n in (4, 8, 16, 32)], alongside=alongside)
    measured = [r for r in results if r.alongside]
    assert len(measured) == 1 and measured[0].kind == A100.kind
    assert [m.candidate_id for m in measured[0].alongside] == [default.id, sm80.id]
    assert all(m.kind == A100.kind for m in measured[0].alongside)
    beside = [r for r in backend.requests if r.candidate_id in (default.id, sm80.id)]
    assert [r.gpu for r in beside] == ["1", "1"]
    # A kind already held measures nothing.
    both = alongside.model_copy(update={"held_on": [H100.kind, A100.kind]})
    assert backend.evaluate(_candidate(4), alongside=both).alongside == []


def test_without_gpus_chosen_the_host_is_one_place_as_before() -> None:
    backend = LocalBackend(timeout_s=60, parallel=3, isolation="none")
    assert backend.places.capacity == 3
    assert [p.gpu for p in backend.places.places] == [None]
    place: Place = backend.places.places[0]
    assert place.timing_locks == (() if not torch.cuda.is_available() else gpus.host_place().timing_locks)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="names here are real GPUs: the two-GPU test's")
def test_each_judge_runs_on_the_gpu_it_was_given(tmp_path: Path) -> None:
    """Real judges: each evaluation's judge runs with CUDA_VISIBLE_DEVICES set to its GPU (here
    names on a CPU host, where they change nothing else), its request carries that GPU's timing
    lock, and a judge on a kind of device whose baselines the caller holds times none."""
    from sandbox.judge import device_info

    backend = LocalBackend(timeout_s=120, scratch_root=tmp_path, keep_scratch=True, gpus=["0", "1"])
    here = device_info(torch.device("cpu")).kind
    # Timed unchecked: what a judge's GPU is shows before any check.
    results = backend.evaluate_many(
        [_candidate(8), _candidate(16)], check=False, baselines=["reference"], baselines_held_on=[here]
    )
    assert [r.status for r in results] == [Status.OK] * 2, [r.message for r in results]
    assert sorted(r.device.visible_devices for r in results) == ["0", "1"]
    assert all(r.kind == here and r.timings for r in results)
    assert not any(t.baselines for r in results for t in r.timings)
    for result in results:
        [request_file] = tmp_path.glob(f"eval-{result.candidate_id}-*/judge/request.json")
        request = json.loads(request_file.read_text())
        assert request["gpu"] == result.device.visible_devices
        assert request["timing_locks"] == [str(lock_path("timing", request["gpu"]))]


@pytest.mark.slow
@pytest.mark.two_gpus
def test_two_gpus_time_at_once_and_never_two_kernels_on_one(tmp_path: Path) -> None:
    """On two real GPUs: every evaluation ran on one of them (its judge saw that one alone),
    both were used, and the timing phases of evaluations on one GPU never overlap."""
    gpus = visible_gpus()[:2]
    backend = LocalBackend(timeout_s=600, scratch_root=tmp_path, gpus=gpus)
    results = backend.evaluate_many([_candidate(n) for n in (4, 8, 16, 32)], trials=1)
    assert [r.status for r in results] == [Status.OK] * 4, [r.message for r in results]
    assert {r.device.visible_devices for r in results} == set(gpus)
    for gpu in gpus:
        windows = sorted(r.timing_window for r in results if r.device.visible_devices == gpu)
        assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:], strict=False)), windows


def test_a_runner_with_a_gpu_of_its_own_gets_that_gpus_device_node_alone(tmp_path: Path) -> None:
    """The nodes its sandbox binds: the driver's control nodes, and one GPU's of the host's."""
    for name in ("nvidia0", "nvidia1", "nvidia12", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        (tmp_path / name).touch()
    (tmp_path / "nvidia-caps").mkdir()
    every = sorted(Path(p).name for p in isolation.gpu_devices(dev=tmp_path))
    assert every == sorted(
        ["nvidia0", "nvidia1", "nvidia12", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps"]
    )
    one = sorted(Path(p).name for p in isolation.gpu_devices(1, dev=tmp_path))
    assert one == sorted(["nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps"])


def test_a_gpus_device_node_is_found_by_its_uuid(tmp_path: Path) -> None:
    for bus, uuid, minor in (("0000:18:00.0", "GPU-aaaa-1111", 3), ("0000:2a:00.0", "GPU-bbbb-2222", 0)):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(
            f"Model: \t\t NVIDIA H100\nGPU UUID: \t {uuid}\n"
            f"Bus Location: \t {bus}\nDevice Minor: \t {minor}\n"
        )
    assert isolation.gpu_minor("aaaa-1111", tmp_path) == 3  # torch's form: without the prefix
    assert isolation.gpu_minor("GPU-BBBB-2222", tmp_path) == 0
    assert isolation.gpu_minor("cccc", tmp_path) is None
    assert isolation.gpu_minor("aaaa-1111", tmp_path / "missing") is None


def test_each_gpu_place_has_cores_of_its_own(tmp_path: Path) -> None:
    """A runner's CPU work (host code, a thread pool, a spin) stays on its place's cores, off
    those of a kernel timed on another GPU: the places split the host's cores between them."""
    assert split_cpus(2, set(range(16))) == [tuple(range(8)), tuple(range(8, 16))]
    assert split_cpus(3, {0, 1, 2, 5, 6, 9, 11}) == [(0, 1, 2), (5, 6), (9, 11)]
    assert split_cpus(4, {0, 1}) == [(0, 1)] * 4  # fewer cores than places: shared
    backend = LocalBackend(gpus=["0", "1"], isolation="none", scratch_root=tmp_path)
    cores = [set(place.cpus) for place in backend.places.places]
    assert not cores[0] & cores[1] or len(os.sched_getaffinity(0)) < 2
    assert cores[0] | cores[1] == os.sched_getaffinity(0)


def test_only_an_evaluation_that_ran_its_course_claims_a_new_kind_for_the_incumbents() -> None:
    """One that failed early (a candidate that raises at import) would choose when the
    incumbents are timed, beside its siblings' work on the host: it claims nothing."""
    kernel = _candidate(4, origin="library")
    claims = AlongsideClaims(Alongside(default=[kernel]))
    stats = TimingStats(median_us=10.0, p20_us=10.0, p80_us=10.0, reps=5)
    timed = [ShapeTiming(shape="s", dtype="fp32", bucket="d64", candidate=stats, flops=1.0, bytes=1.0,
                         achieved_gbps=1.0)]  # fmt: skip
    base = {"problem": "embedding_bag", "candidate_id": "c", "device": H100}
    assert claims.claim(EvalResult(status=Status.COMPILE_ERROR, message="raised at import", **base)) == []
    assert claims.claim(EvalResult(status=Status.OK, **base)) == []  # checked, not timed
    assert claims.claim(EvalResult(status=Status.OK, timings=timed, **base)) == [kernel]
    assert claims.claim(EvalResult(status=Status.OK, timings=timed, **base)) == []  # the kind is claimed


def test_the_judge_takes_the_backends_node_only_where_it_is_its_own_gpus(monkeypatch) -> None:
    from types import SimpleNamespace

    from sandbox import judge

    probes: list[int] = []
    monkeypatch.setattr(judge.torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="GPU-a"))
    monkeypatch.setattr(isolation, "gpu_minor", lambda uuid: 4 if uuid == "GPU-a" else None)
    monkeypatch.setattr(isolation, "one_gpu_sandbox_works", lambda minor: probes.append(minor) or False)
    assert judge._own_gpu_node(4) == 4 and probes == []  # the backend's probe, for this GPU
    assert judge._own_gpu_node(7) is None and probes == [4]  # another GPU's node: asked, and refused
    assert judge._own_gpu_node(None) is None and probes == [4, 4]


def test_the_judge_refuses_a_gpu_that_is_not_the_one_the_backend_locked(monkeypatch) -> None:
    """The backend named the place's GPU by its UUID and took that GPU's locks: a judge whose
    CUDA_VISIBLE_DEVICES index reads as another GPU (another CUDA_DEVICE_ORDER) must not time
    there. MIG instances are taken as named."""
    from types import SimpleNamespace

    from sandbox import judge

    monkeypatch.setattr(
        judge.torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="GPU-AAAA-0001")
    )

    def request(gpu: str | None, uuid: str | None) -> SimpleNamespace:
        return SimpleNamespace(gpu=gpu, gpu_uuid=uuid)

    judge._check_own_gpu(request("1", "gpu-aaaa-0001"))  # the same GPU, written otherwise
    judge._check_own_gpu(request("1", None))  # not known: nothing to compare
    judge._check_own_gpu(request(None, "GPU-bbbb-0002"))  # the host's GPUs as one place
    judge._check_own_gpu(request("MIG-1/2/0", "GPU-bbbb-0002"))
    with pytest.raises(RuntimeError, match="its locks are another GPU's"):
        judge._check_own_gpu(request("1", "GPU-bbbb-0002"))


def test_the_one_gpu_probe_counts_every_gpu_the_sandbox_reaches(monkeypatch) -> None:
    """The probe runs without CUDA_VISIBLE_DEVICES: with it set to 0, one GPU would be counted
    however many nodes the sandbox held."""
    seen: list[dict] = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(isolation, "bwrap_command", lambda scratch, argv, **kw: argv)
    monkeypatch.setattr(isolation, "_libcuda_dir", lambda: None)
    monkeypatch.setattr(
        isolation.subprocess, "run", lambda cmd, env, **kw: seen.append(env) or SimpleNamespace(returncode=0)
    )
    assert isolation.one_gpu_sandbox_works.__wrapped__(5)
    assert "CUDA_VISIBLE_DEVICES" not in seen[0]


def test_a_campaign_on_a_gpu_host_whose_driver_names_no_gpu_says_so(monkeypatch, tmp_path: Path) -> None:
    from agent.campaign import CampaignError, make_backend
    from agent.config import SandboxConfig

    monkeypatch.setattr(local, "cuda_present", lambda: True)
    monkeypatch.setattr(gpus, "gpu_uuids", lambda: None)
    with pytest.raises(
        CampaignError, match="cannot evaluate on this host's GPUs: the CUDA driver named no GPU"
    ):
        make_backend(SandboxConfig(isolation="none"), tmp_path / "scratch")
