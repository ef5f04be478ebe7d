"""A control group per runner, where the host lets a root judge make one (sandbox.isolation, rule
resources): it bounds the memory and the tasks of everything the runner starts, counted there
alone (RLIMIT_NPROC counts every task of the runner's user on the host, other runners' too, so
one runner's budget hung on the others'), and says when the kernel killed the runner at its
memory limit. cgroup v2 where the unified hierarchy holds the memory and pids controllers, else
the v1 hierarchies of the two; None where neither can be written (not root, a read-only
cgroupfs, a container's own cgroup): the runner then keeps its resource limits alone.
Standard library only."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = "recforge-runners"  # beside the host's own groups, one level below each hierarchy's root
CONTROLLERS = ("memory", "pids")


@dataclass(frozen=True)
class RunnerCgroup:
    """One runner's group: a directory of the unified hierarchy, or one per v1 controller."""

    dirs: tuple[Path, ...]
    memory_bytes: int

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` started inside the group: a shell writes its own pid into each group's
        `cgroup.procs`, then becomes `argv`, so nothing it starts is ever outside it (no
        preexec_fn: the judge has threads)."""
        enter = " && ".join(f'echo $$ > "${i + 1}"' for i in range(len(self.dirs)))
        script = f'{enter} && shift {len(self.dirs)} && exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *(str(d / "cgroup.procs") for d in self.dirs), *argv]

    def tasks(self) -> list[int]:
        """The host pids of the group's processes."""
        with contextlib.suppress(OSError, ValueError):
            return [int(pid) for pid in (self.dirs[0] / "cgroup.procs").read_text().split()]
        return []

    def killed_at_memory_limit(self) -> bool:
        """Whether the kernel's OOM killer ended a task of the group at its memory limit."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):  # v2, v1
                with contextlib.suppress(OSError, ValueError):
                    fields = dict(line.split() for line in (d / name).read_text().splitlines())
                    if int(fields.get("oom_kill", "0")) > 0:
                        return True
        return False

    def kill(self) -> None:
        """Every task of the group, killed (the runner's PID namespace dies with bubblewrap as
        well: this holds where a task got out of it)."""
        kill_all = self.dirs[0] / "cgroup.kill"  # v2, Linux 5.14 and later
        if kill_all.exists():
            with contextlib.suppress(OSError):
                kill_all.write_text("1")
                return
        for pid in self.tasks():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, wait_s: float = 5.0) -> None:
        """The group's directories, removed once its tasks are gone (they exit asynchronously
        after a kill; an empty group left behind holds nothing)."""
        end = time.monotonic() + wait_s
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > end:
                        break
                    time.sleep(0.05)


def remove_groups_of(judge_pid: int) -> None:
    """The groups a judge made (named `<its pid>-...`), once it has ended: a judge killed at its
    hard limit never removes its runner's group itself. Their tasks are killed first."""
    for root in (CGROUP_ROOT, *(CGROUP_ROOT / c for c in CONTROLLERS)):
        groups = tuple((root / PARENT).glob(f"{judge_pid}-*"))
        if groups:
            group = RunnerCgroup(dirs=groups, memory_bytes=0)
            group.kill()
            group.remove()


def create(name: str, *, memory_bytes: int, max_tasks: int) -> RunnerCgroup | None:
    """A new group `name` holding its tasks to `memory_bytes` of memory (no swap beside it) and
    `max_tasks` processes and threads; None where this host gives the judge none."""
    if os.geteuid() != 0:
        return None
    try:
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            return _create_v2(name, memory_bytes, max_tasks)
        return _create_v1(name, memory_bytes, max_tasks)
    except OSError:
        return None


def _create_v2(name: str, memory_bytes: int, max_tasks: int) -> RunnerCgroup | None:
    available = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
    if not all(c in available for c in CONTROLLERS):
        return None
    parent = CGROUP_ROOT / PARENT
    parent.mkdir(exist_ok=True)
    # A group hands controllers to its children only once its parent enabled them for it; the
    # parent group holds no task, as v2 requires of a group that does.
    enable = " ".join(f"+{c}" for c in CONTROLLERS)
    for group in (CGROUP_ROOT, parent):
        enabled = (group / "cgroup.subtree_control").read_text().split()
        if not all(c in enabled for c in CONTROLLERS):
            (group / "cgroup.subtree_control").write_text(enable)
    group = parent / name
    group.mkdir()
    try:
        (group / "memory.max").write_text(str(memory_bytes))
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
        (group / "pids.max").write_text(str(max_tasks))
    except OSError:
        group.rmdir()
        raise
    return RunnerCgroup(dirs=(group,), memory_bytes=memory_bytes)


def _create_v1(name: str, memory_bytes: int, max_tasks: int) -> RunnerCgroup | None:
    roots = [CGROUP_ROOT / c for c in CONTROLLERS]
    if not all((root / "cgroup.procs").exists() for root in roots):
        return None
    memory, pids = (root / PARENT / name for root in roots)
    made: list[Path] = []
    try:
        for group in (memory, pids):
            group.mkdir(parents=True)
            made.append(group)
        (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
        if (memory / "memory.memsw.limit_in_bytes").exists():
            (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        (pids / "pids.max").write_text(str(max_tasks))
    except OSError:
        for group in made:
            with contextlib.suppress(OSError):
                group.rmdir()
        raise
    return RunnerCgroup(dirs=(memory, pids), memory_bytes=memory_bytes)
