"""The runner's confinement of itself, before anything else exists in its process: resource
limits, and under a root judge the drop to an unprivileged user in a user namespace of its own
(see sandbox.isolation, rule user). Standard library only, and nothing that starts a thread.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource

_CLONE_NEWUSER = 0x10000000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_SYS_CAPSET = 126  # x86_64
_CAPABILITY_VERSION_3 = 0x20080522


def die_with_parent(parent: int) -> None:
    """SIGKILL for this process when `parent` (the process that started it) ends, however it
    ends: a judge outlives no campaign, so nothing it started keeps the GPU after a kill. Exits
    at once if `parent` is already gone. Linux only (elsewhere nothing is set)."""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(1)


def become_unprivileged(uid: int) -> None:
    """From root (in the sandbox's mount, PID and network namespaces) to `uid` with no
    capability anywhere, in a user namespace of its own that maps `uid` to itself (see
    sandbox.isolation, rule user). Runs before any candidate code exists in the process."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what} failed")

    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # every capability of the host's namespace goes with root
    # A changed uid makes the process undumpable, and /proc/self root's: the maps below need it.
    check(libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    check(libc.unshare(_CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{uid} {uid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    # The new namespace gave this process every capability inside it: drop them all.
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    check(libc.syscall(_SYS_CAPSET, header, data), "capset")
    check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def apply_limits(cpu_seconds: int | None, address_space: int | None) -> None:
    """The runner's resource limits, set on itself before any candidate code exists (the bound
    on tasks comes after the drop to its user: see limit_tasks)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, 1 << 30))  # no file over 1 GiB in scratch
    if cpu_seconds is not None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    if address_space is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))


def limit_tasks(max_tasks: int | None) -> None:
    """Rule resources (sandbox.isolation): at most `max_tasks` processes and threads of the
    runner's user (sandbox.isolation.task_limit), so a fork bomb ends in EAGAIN and not in a
    host without free PIDs. Set once the runner is that user and in its own user namespace:
    root ignores the bound."""
    if max_tasks is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        if hard != resource.RLIM_INFINITY:
            max_tasks = min(max_tasks, hard)  # the judge's user is held to fewer already
        resource.setrlimit(resource.RLIMIT_NPROC, (max_tasks, max_tasks))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sandbox.runner")
    parser.add_argument("fd", nargs="?", type=int, help="the judge's channel, inherited")
    parser.add_argument("--connect", help="the judge's channel, a Unix socket to connect to")
    parser.add_argument("--become", type=int, help="uid to drop to from root (sandbox.isolation)")
    parser.add_argument("--cpu-seconds", type=int)
    parser.add_argument("--address-space", type=int)
    parser.add_argument("--max-tasks", type=int, help="bound on the runner user's tasks (RLIMIT_NPROC)")
    parser.add_argument("--parent", type=int, help="the judge's pid: the runner dies with it")
    return parser.parse_args(argv)


def confine(args: argparse.Namespace) -> None:
    if args.parent is not None:  # outside bubblewrap (whose --die-with-parent does this)
        die_with_parent(args.parent)
    apply_limits(args.cpu_seconds, args.address_space)
    if args.become is not None:
        become_unprivileged(args.become)
    limit_tasks(args.max_tasks)
