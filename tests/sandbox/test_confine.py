"""sandbox.confine outside the sandbox: a judge started with its parent's pid dies with it."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox.isolation import REPO_ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# The middle process starts a child that asks to die with it, prints the child's pid and waits
# for a line on stdin before it exits (so the test decides when the parent ends).
MIDDLE = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import os, sys, time; "
    "from sandbox.confine import die_with_parent; die_with_parent(int(sys.argv[1])); "
    "print('armed', flush=True); time.sleep(120)", str(os.getpid())], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
sys.stdin.readline()
os._exit(0)  # no wait for the child: only the kernel's signal can end it
"""


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        state = next(line for line in status.read_text().splitlines() if line.startswith("State:"))
    except FileNotFoundError:
        return False
    return "Z" not in state.split()[1]  # a zombie has ended; only its reaping is left


def test_a_process_that_asked_dies_with_its_parent() -> None:
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE],
        cwd=REPO_ROOT,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    child = int(middle.stdout.readline())
    assert _alive(child), "the child ended before its parent did"
    middle.stdin.write("\n")
    middle.stdin.flush()
    middle.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the child outlived its parent"


def test_a_process_whose_parent_is_gone_exits_at_once() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = (
        "import sys; from sandbox.confine import die_with_parent; die_with_parent(int(sys.argv[1])); print(1)"
    )
    argv = [sys.executable, "-c", code, str(gone.pid)]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""


# A judge's stand-in: it starts a runner with `isolation="none"` (its own session, as under
# bubblewrap, so a kill of the judge's process group misses it) on a channel whose other end the
# test holds (so the runner waits for a request, as a runner busy with a candidate would, instead
# of seeing its judge hang up), prints the runner's pid and waits to be killed.
JUDGE = """
import subprocess, sys, time
from pathlib import Path
from sandbox import isolation
fd = int(sys.argv[2])
argv = [sys.executable, "-P", "-m", "sandbox.runner", str(fd), "--cpu-seconds", "60"]
runner = isolation.start_runner(argv, Path(sys.argv[1]), gpu=False, pass_fds=(fd,),
                                stdout=subprocess.DEVNULL, isolation="none")
print(runner.pid, flush=True)
time.sleep(120)
"""


def test_an_unisolated_runner_dies_with_its_judge(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    judge = subprocess.Popen(
        [sys.executable, "-c", JUDGE, str(tmp_path), str(theirs.fileno())],
        cwd=REPO_ROOT, text=True, stdout=subprocess.PIPE, pass_fds=(theirs.fileno(),),
    )  # fmt: skip
    theirs.close()
    runner = int(judge.stdout.readline())
    time.sleep(1.0)  # the runner is up and has asked to die with the judge
    assert _alive(runner)
    judge.kill()  # SIGKILL: nothing of the judge's own runs
    judge.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(runner) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(runner)
    if alive:
        os.kill(runner, signal.SIGKILL)
    ours.close()
    assert not alive, "the runner outlived its judge"
