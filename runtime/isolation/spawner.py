"""Start the node's programs from a process that holds almost no descriptors.

Why: a fork copies the parent's whole descriptor table and the exec then
closes every close-on-exec entry of the copy, in the kernel, one by one. The
node holds a few descriptors per sandbox (its seccomp notifications, user
namespaces), so at 3,000 sandboxes every `runc run` it started cost ~5 ms of
system CPU before runc ran at all (filp_flush / dnotify_flush in a profile),
growing with the node. The spawner is started once, when the node has few
descriptors, and starts what the node asks of it with exactly the
descriptors the request carries.

Protocol: one SOCK_SEQPACKET socketpair between the node and the spawner
(no path: nothing else can reach it). A request is a JSON object {"argv",
"env", "targets"} with descriptors passed alongside (SCM_RIGHTS): the first
is the request's reply socket, the others are placed at `targets` in the
child. The spawner answers on the reply socket {"pid": N} (or {"error":
"..."}), then {"status": exit code} once the child has exited. JSON only:
nothing is unpickled. The spawner exits when the node's end closes; children
it started are not killed by that.

Run by path (`python -I spawner.py FD`): it imports nothing but the
standard library.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MAX_REQUEST = 1 << 20
MAX_FDS = 16


class SpawnError(OSError):
    """The spawner could not start the program (the message says why)."""


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(
        MAX_FDS * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


class Spawner:
    """The node's end: start()ed lazily on first use, one per process."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _control(self) -> socket.socket:
        with self._lock:
            if self._sock is None or (self._proc is not None and self._proc.poll() is not None):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-I", str(Path(__file__).resolve()),
                         str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                        start_new_session=True)
                finally:
                    theirs.close()
                if self._sock is not None:
                    self._sock.close()
                self._sock = ours
            return self._sock

    def run(self, argv: list[str], fds: Mapping[int, int], timeout: float,
            env: Mapping[str, str] | None = None) -> int:
        """Start argv with each descriptor fds[target] at `target` (the
        child gets nothing else), wait for it, return its exit status;
        killed (SIGKILL) after `timeout` seconds or when the wait fails."""
        reply, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = None
        try:
            targets = list(fds)
            request = json.dumps({"argv": argv, "env": dict(os.environ if env is None else env),
                                  "targets": targets}).encode()
            try:
                socket.send_fds(self._control(), [request],
                                [child_end.fileno(), *(fds[t] for t in targets)])
            finally:
                child_end.close()
            reply.settimeout(30)
            first = json.loads(reply.recv(MAX_REQUEST) or b'{"error": "spawner gone"}')
            if "pid" not in first:
                raise SpawnError(f"starting {argv[0]}: {first.get('error')}")
            pid = int(first["pid"])
            reply.settimeout(timeout)
            try:
                last = reply.recv(MAX_REQUEST)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                reply.settimeout(30)
                last = reply.recv(MAX_REQUEST)
            status = json.loads(last or b"{}").get("status")
            if status is None:
                raise SpawnError(f"{argv[0]}: the spawner lost it")
            pid = None
            return int(status)
        finally:
            if pid is not None:  # failed while it ran: it must not go on alone
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            reply.close()

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(5)
                if self._proc.poll() is None:
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None


# -- the spawner process -------------------------------------------------------
def _serve_one(msg: bytes, fds: list[int]) -> None:
    reply = socket.socket(fileno=fds[0])
    given = fds[1:]
    try:
        try:
            req = json.loads(msg)
            argv, env, targets = list(req["argv"]), dict(req["env"]), list(req["targets"])
            if len(targets) != len(given):
                raise ValueError("descriptors and targets differ in number")
            actions: list[tuple[Any, ...]] = [
                (os.POSIX_SPAWN_DUP2, fd, int(t)) for fd, t in zip(given, targets)]
            actions += [(os.POSIX_SPAWN_OPEN, std, os.devnull, os.O_RDWR, 0)
                        for std in (0, 1, 2) if std not in targets]  # not ours
            pid = os.posix_spawn(argv[0], argv, env, file_actions=actions,
                                 setsigdef=(signal.SIGPIPE,))
        except (OSError, ValueError, KeyError, TypeError) as e:
            with contextlib.suppress(OSError):
                reply.send(json.dumps({"error": str(e)}).encode())
            return
        finally:
            for fd in given:
                os.close(fd)
        with contextlib.suppress(OSError):
            reply.send(json.dumps({"pid": pid}).encode())
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with contextlib.suppress(OSError):
            reply.send(json.dumps({"status": status}).encode())
    finally:
        reply.close()


def serve(fd: int) -> None:
    os.set_inheritable(fd, False)  # what it starts gets the request's only
    control = socket.socket(fileno=fd)
    while True:
        try:
            msg, fds = _recv(control)
        except InterruptedError:
            continue
        if not msg and not fds:
            return  # the node is gone
        if not fds:
            continue
        threading.Thread(target=_serve_one, args=(msg, fds), daemon=True).start()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node's ^C is the node's
    serve(int(sys.argv[1]))
