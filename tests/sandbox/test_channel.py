"""The judge's channel to a sandboxed runner: shared regions both ways, the runner's identity and
confinement, and what it refuses (bwrap must run here; the GPU variant on a CUDA host)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from sandbox import isolation, shared, wire

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

needs_bwrap = pytest.mark.skipif(
    isolation.bwrap_works() is not None, reason=f"no sandbox here: {isolation.bwrap_works()}"
)

PROBE = """
import os, torch

def double(x, *, scale=2.0):
    return x * scale

def identity(x):
    return x

def whoami(x):
    status = open("/proc/self/status").read()
    uid = int(status.split("Uid:")[1].split()[0])
    cap = int(status.split("CapEff:")[1].split()[0], 16)
    pids = len([p for p in os.listdir("/proc") if p.isdigit()])
    sees_git = int(os.path.exists("/work/main/.git"))
    return torch.tensor([uid, cap, pids, sees_git], dtype=torch.float32, device=x.device)
"""


class Judge:
    """The judge's end of one runner, as sandbox.judge drives it."""

    def __init__(self, tmp: Path, device: str, source: str = PROBE) -> None:
        self.device = device
        self.sock, runner_end = wire.socket_pair()
        scratch = tmp / "runner"
        scratch.mkdir()
        (scratch / "candidate.py").write_text(source)
        self.log = open(tmp / "runner.log", "wb")  # noqa: SIM115 - closed by close()
        argv = [sys.executable, "-m", "sandbox.runner", str(runner_end.fileno())]
        self.proc = isolation.start_runner(
            argv, scratch, gpu=device == "cuda", pass_fds=(runner_end.fileno(),), stdout=self.log
        )
        runner_end.close()
        self.regions: dict[int, shared.Region] = {}

    def ask(self, message: dict, fds: tuple[int, ...] = ()) -> dict:
        wire.send(self.sock, message, fds)
        reply, _ = wire.receive(self.sock, time.monotonic() + 120)
        return reply

    def region(self, rid: int, nbytes: int) -> shared.Region:
        region, fd = shared.create_region(self.device, nbytes)
        try:
            assert self.ask({"op": "region", "id": rid, "device": self.device, "nbytes": nbytes}, (fd,))["ok"]
        finally:
            os.close(fd)
        self.regions[rid] = region
        return region

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture
def judge(tmp_path: Path, request: pytest.FixtureRequest):
    device = request.param
    if device == "cuda" and not CUDA:
        pytest.skip("needs a CUDA GPU")
    j = Judge(tmp_path, device)
    yield j
    j.close()


def _arg(rid: int, offset: int, t: torch.Tensor) -> dict:
    return {"t": {"region": rid, "offset": offset, "dtype": shared.dtype_name(t.dtype),
                  "shape": list(t.shape), "strides": list(t.stride())}}  # fmt: skip


@needs_bwrap
@pytest.mark.parametrize("judge", DEVICES, indirect=True)
def test_inputs_and_outputs_cross_through_shared_regions(judge: Judge) -> None:
    inputs = judge.region(1, 1 << 20)
    x = inputs.view(0, torch.bfloat16, (3, 5), (5, 1))
    x.copy_(torch.randn(3, 5, device=judge.device).to(torch.bfloat16))
    assert judge.ask({"op": "load", "source_file": "/scratch/candidate.py", "entry": "double"})["ok"]
    reply = judge.ask(
        {"op": "run", "calls": [{"id": 1, "args": [_arg(1, 0, x)], "kwargs": {"scale": {"v": 3.0}}}]}
    )
    assert reply["ok"], reply
    (call,) = reply["calls"]
    assert call["outputs"] == [
        {"dtype": "bfloat16", "shape": [3, 5], "strides": [5, 1], "device": judge.device}
    ]
    outputs = judge.region(2, 1 << 20)
    assert judge.ask({"op": "fetch", "region": 2, "items": [{"call": 1, "output": 0, "offset": 512}]})["ok"]
    got = outputs.view(512, torch.bfloat16, (3, 5), (5, 1))
    torch.testing.assert_close(got, x * 3.0)


@needs_bwrap
@pytest.mark.parametrize("judge", DEVICES, indirect=True)
def test_runner_flags_an_output_that_is_its_input(judge: Judge) -> None:
    inputs = judge.region(1, 4096)
    x = inputs.view(0, torch.float32, (8,), (1,))
    assert judge.ask({"op": "load", "source_file": "/scratch/candidate.py", "entry": "identity"})["ok"]
    (call,) = judge.ask({"op": "run", "calls": [{"id": 1, "args": [_arg(1, 0, x)], "kwargs": {}}]})["calls"]
    assert call["problem"] == "the output shares memory with an input"


@needs_bwrap
@pytest.mark.parametrize("judge", DEVICES, indirect=True)
def test_runner_is_unprivileged_alone_and_sees_no_repository(judge: Judge) -> None:
    inputs = judge.region(1, 4096)
    x = inputs.view(0, torch.float32, (1,), (1,))
    assert judge.ask({"op": "load", "source_file": "/scratch/candidate.py", "entry": "whoami"})["ok"]
    assert judge.ask({"op": "run", "calls": [{"id": 1, "args": [_arg(1, 0, x)], "kwargs": {}}]})["ok"]
    outputs = judge.region(2, 4096)
    assert judge.ask({"op": "fetch", "region": 2, "items": [{"call": 1, "output": 0, "offset": 0}]})["ok"]
    uid, cap, num_processes, sees_git = outputs.view(0, torch.float32, (4,), (1,)).tolist()
    assert uid == isolation.NOBODY and cap == 0
    # Its own PID namespace: bubblewrap's init and the runner, none of the host's processes.
    assert num_processes <= 3
    assert sees_git == 0


def test_a_truncated_or_malformed_message_is_refused() -> None:
    a, b = wire.socket_pair()
    a.sendall(b"[1, 2]")
    with pytest.raises(wire.BadMessage, match="not an object"):
        wire.receive(b, time.monotonic() + 5)
    a.sendall(b"\xff\xfe")
    with pytest.raises(wire.BadMessage, match="not JSON"):
        wire.receive(b, time.monotonic() + 5)
    a.sendall(b"x" * (wire.MAX_MESSAGE + 10))
    with pytest.raises(wire.BadMessage, match="over"):
        wire.receive(b, time.monotonic() + 5)
    with pytest.raises(wire.ChannelTimeout):
        wire.receive(b, time.monotonic() + 0.2)
    a.close()
    with pytest.raises(wire.ChannelClosed):
        wire.receive(b, time.monotonic() + 5)


def test_a_view_cannot_reach_past_its_region() -> None:
    region, fd = shared.create_region("cpu", 1024)
    os.close(fd)
    with pytest.raises(shared.SharedMemoryError, match="overruns"):
        region.view(1000, torch.float32, (8,), (1,))
    with pytest.raises(shared.SharedMemoryError, match="overruns"):
        region.view(0, torch.float32, (2, 2), (1000, 1))


def test_a_message_nested_past_the_stack_is_a_bad_message() -> None:
    ours, theirs = wire.socket_pair()
    try:
        theirs.send(b"[" * 500_000)
        with pytest.raises(wire.BadMessage, match="RecursionError"):
            wire.receive(ours, time.monotonic() + 5)
    finally:
        ours.close()
        theirs.close()


def test_a_waiting_message_is_pending_and_a_closed_channel_is_not() -> None:
    ours, theirs = wire.socket_pair()
    try:
        assert not wire.pending(ours)
        wire.send(theirs, {"ok": True})
        assert wire.pending(ours) and wire.pending(ours)  # a peek reads nothing
        assert wire.receive(ours, time.monotonic() + 5)[0] == {"ok": True}
        assert not wire.pending(ours)
        theirs.close()
        assert not wire.pending(ours)
        with pytest.raises(wire.ChannelClosed):
            wire.receive(ours, time.monotonic() + 5)
    finally:
        ours.close()
