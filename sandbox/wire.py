"""The judge's channel to its runner: one JSON object per message over a Unix SOCK_SEQPACKET
socket, with file descriptors (shared regions) attached where a message carries them.

Datagram-like packets keep message boundaries, so a runner cannot desynchronize the stream; a
message larger than MAX_MESSAGE is truncated by the kernel, which the receiver sees and refuses.
Everything the judge receives is parsed as data (JSON, never pickle) and checked by the caller.

Imports the standard library only: the runner imports this before any candidate code.
"""

from __future__ import annotations

import array
import contextlib
import json
import socket
import time

MAX_MESSAGE = 1 << 20  # bytes; event timings of a batch and output descriptions fit many times
MAX_FDS = 8


class ChannelClosed(ConnectionError):
    """The peer closed its end (it exited or died)."""


class ChannelTimeout(TimeoutError):
    """No message came before the deadline."""


class BadMessage(ValueError):
    """What came is not a message of this protocol: truncated, not JSON, or not an object."""


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(judge end, runner end); the runner's end is inheritable, for the runner's process."""
    judge, runner = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (judge, runner):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_MESSAGE)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2 * MAX_MESSAGE)
    runner.set_inheritable(True)
    return judge, runner


def send(sock: socket.socket, message: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise BadMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def receive(sock: socket.socket, deadline: float | None = None) -> tuple[dict, list[int]]:
    """The next message and the descriptors it carried; `deadline` is a time.monotonic() value."""
    if deadline is None:
        sock.settimeout(None)
    else:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ChannelTimeout("no message before the deadline")
        sock.settimeout(remaining)
    fd_bytes = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    try:
        data, ancillary, flags, _ = sock.recvmsg(MAX_MESSAGE + 1, fd_bytes)
    except TimeoutError as exc:
        raise ChannelTimeout("no message before the deadline") from exc
    except ConnectionResetError as exc:
        raise ChannelClosed("the peer reset the connection") from exc
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    if not data and not fds:
        raise ChannelClosed("the peer closed the channel")
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE:
            raise BadMessage(f"a message over {MAX_MESSAGE} bytes (or with too many descriptors)")
        try:
            message = _valid_text(json.loads(data))
        except (ValueError, RecursionError) as exc:  # bad JSON or text; nesting past the stack
            raise BadMessage(f"not JSON: {type(exc).__name__}: {str(exc)[:200]}") from exc
        if not isinstance(message, dict):
            raise BadMessage(f"a JSON {type(message).__name__}, not an object")
    except BadMessage:
        for fd in fds:
            _close_quietly(fd)
        raise
    return message, fds


def _valid_text(value):
    """`value` with every string made valid Unicode: JSON's escapes can spell a lone surrogate,
    which no UTF-8 writer (the judge's result file) takes; it becomes "?"."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "replace").decode("utf-8")
        return value
    if isinstance(value, list):
        return [_valid_text(v) for v in value]
    if isinstance(value, dict):
        return {_valid_text(k): _valid_text(v) for k, v in value.items()}
    return value


def pending(sock: socket.socket) -> bool:
    """Whether a message is already waiting on `sock` (read nothing). A closed or reset channel
    has none: the next receive says what became of the peer."""
    sock.settimeout(None)
    try:
        # No room for descriptors: a peek at a message that carries some takes none of them.
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return False
    return bool(data)  # b"": the peer closed the channel


def _close_quietly(fd: int) -> None:
    import os

    with contextlib.suppress(OSError):
        os.close(fd)
