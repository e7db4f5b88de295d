"""The host side of a container's exec channel: commands started by the
sandbox's own init (runtime/native/sandbox-init.c, "the exec channel").

The node binds a unix socket under the sandbox's directory on the host and
hands the listening socket to init as its stdin when runc starts it; no
process of the sandbox can name the path (it is outside the sandbox's mount
namespace) or take init's descriptor (init is non-dumpable and the sandbox has
no CAP_SYS_PTRACE). One connection carries one command: the request (cwd,
argv, env, and the command's stdin/stdout/stderr pipes as SCM_RIGHTS) and
init's replies STARTED and EXITED, bound to the request's id. So no process of
the sandbox can forge, drop or reorder what the caller receives, and an exec
costs a fork in the sandbox instead of a `runc exec` (a Go process start and
a tour of the sandbox's namespaces and cgroups).

Before a checkpoint the node moves the channel (`move_channel`) to a
listening socket it made in the sandbox's own network namespace under a
random abstract name (an `AbstractChannel`): CRIU saves and restores that one
with the sandbox, where a socket of the host's namespace cannot be saved.
Sandbox processes can see and connect to an abstract name; init serves only
peers outside the sandbox's PID namespace (SO_PEERCRED pid 0), so their
connections are closed unanswered.

What this module does not own: the command's deadline, output caps and tree
kill (runtime/backends/procio.py and the container backend).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
import struct
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

MAGIC = 0x3158454C  # "LEX1", as init checks it
CLONE_NEWNET = 0x40000000
REQUEST = struct.Struct("<IIQII")   # magic, payload length, id, flags, nargs
REPLY = struct.Struct("<IiQii")     # kind, value (wait status), id, pid, errno
STARTED, EXITED, FORK_FAILED, BAD = (ord(c) for c in "SXFB")
FLAG_IDLE = 1
FLAG_LISTENER = 2  # the request's one descriptor becomes init's listening socket
FLAG_RW = 4  # one descriptor: init's rw/ (RW_FD); none: init closes it
MAX_PAYLOAD = 4 << 20
START_TIMEOUT = 10.0
_ids = itertools.count(1)


class ChannelError(Exception):
    """The exec channel could not start the command (init gone, frozen, or
    refusing); `errno` is set when init's fork failed."""

    def __init__(self, msg: str, errno: int = 0) -> None:
        super().__init__(msg)
        self.errno = errno


@contextmanager
def _short_path(path: Path) -> Iterator[str]:
    """A name for `path` that fits sockaddr_un (108 bytes): the path itself, or
    /proc/self/fd/N/NAME through an O_PATH descriptor of its directory."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{dfd}/{path.name}"
    finally:
        os.close(dfd)


@dataclass(frozen=True)
class AbstractChannel:
    """An exec channel under an abstract name in a sandbox's network
    namespace (`netns`: /proc/INIT/ns/net), as it is after a checkpoint."""

    netns: Path
    name: str

    @property
    def address(self) -> bytes:
        return b"\0" + self.name.encode()


Channel = Path | AbstractChannel  # a host path (as runc started the sandbox) or abstract

_libc = ctypes.CDLL(None, use_errno=True)


def _socket_in(netns: Path) -> socket.socket:
    """A unix stream socket of the network namespace `netns` (made by this
    thread inside it; the thread goes back to its own namespace at once)."""
    with open("/proc/thread-self/ns/net", "rb") as own, open(netns, "rb") as there:
        if _libc.setns(there.fileno(), CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise ChannelError(f"entering the network namespace {netns}: {os.strerror(e)}", e)
        try:
            return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        finally:
            if _libc.setns(own.fileno(), CLONE_NEWNET) != 0:  # cannot go on in theirs
                os._exit(70)


def _connect(s: socket.socket, channel: Channel) -> None:
    if isinstance(channel, AbstractChannel):
        s.connect(channel.address)
        return
    with _short_path(channel) as name:
        s.connect(name)


def _open(channel: Channel) -> socket.socket:
    if isinstance(channel, AbstractChannel):
        return _socket_in(channel.netns)
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)


def move_channel(channel: Channel, to: AbstractChannel) -> None:
    """Make init serve `to` instead of `channel`: a listening socket made in
    to.netns under to.name is handed to init, which drops the old one. Returns
    once init has closed the connection it came over (nothing of the host's
    namespace is left in the sandbox)."""
    lsock = _socket_in(to.netns)
    try:
        lsock.bind(to.address)
        lsock.listen(128)
        with _open(channel) as s:
            s.settimeout(START_TIMEOUT)
            _connect(s, channel)
            header = REQUEST.pack(MAGIC, 0, next(_ids), FLAG_LISTENER, 0)
            socket.send_fds(s, [header], [lsock.fileno()])
            reply = s.recv(REPLY.size, socket.MSG_WAITALL)
            if len(reply) != REPLY.size or REPLY.unpack(reply)[0] != STARTED:
                raise ChannelError("the sandbox's init refused the new exec channel")
            while s.recv(64):  # init closes its end after the reply
                pass
    except OSError as e:
        raise ChannelError(f"moving the exec channel to {to.name}: {e}", e.errno or 0) from e
    finally:
        lsock.close()


def _control(channel: Channel, flag: int, fds: list[int], what: str) -> None:
    """One control request to init (no command): `flag` with `fds`; returns
    once init answered and closed the connection."""
    try:
        with _open(channel) as s:
            s.settimeout(START_TIMEOUT)
            _connect(s, channel)
            header = REQUEST.pack(MAGIC, 0, next(_ids), flag, 0)
            socket.send_fds(s, [header], fds)
            reply = s.recv(REPLY.size, socket.MSG_WAITALL)
            if len(reply) != REPLY.size or REPLY.unpack(reply)[0] != STARTED:
                raise ChannelError(f"the sandbox's init refused {what}")
            while s.recv(64):  # init closes its end after the reply
                pass
    except OSError as e:
        raise ChannelError(f"{what}: {e}", e.errno or 0) from e


def give_rw(channel: Channel, rw: int | None) -> None:
    """Give init the sandbox's rw/ as its descriptor RW_FD (`rw`), or make
    it close that descriptor (None: before a checkpoint, which cannot save
    a descriptor of a mount outside the sandbox)."""
    _control(channel, FLAG_RW, [] if rw is None else [rw],
             "handing rw/ to init" if rw is not None else "taking rw/ from init")


def listen(path: Path) -> socket.socket:
    """The listening socket init serves (bound at `path`, mode 0600)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short_path(path) as name:
            # mode 0600 from the socket itself, not the process-wide umask
            # (threads saving and restoring it at once could leave it 0177)
            os.fchmod(s.fileno(), 0o600)
            s.bind(name)
        s.listen(128)
    except BaseException:
        s.close()
        raise
    return s


@dataclass
class _Stream:
    """What procio reads and writes: one end of a command's pipe."""

    fd: int

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class InitCommand:
    """One command started by the sandbox's init, shaped like the part of
    subprocess.Popen that procio.run drives (pipes, wait, kill)."""

    def __init__(self, channel: Channel, argv: tuple[str, ...], *, cwd: str, env: dict[str, str],
                 idle: bool, on_kill: Callable[[], None]) -> None:
        payload = b"".join(os.fsencode(s) + b"\0" for s in (cwd, *argv)) + b"".join(
            os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items())
        if len(payload) > MAX_PAYLOAD:
            raise ChannelError(f"the command and its environment exceed {MAX_PAYLOAD >> 20} MiB")
        self.id = next(_ids)
        self._on_kill = on_kill
        self.returncode: int | None = None
        self.exec_errno = 0
        self.sock = _open(channel)
        ends: list[int] = []
        mine: list[int] = []
        try:
            self.sock.settimeout(START_TIMEOUT)
            _connect(self.sock, channel)
            for _ in range(3):
                r, w = os.pipe()
                ends.append(r)
                ends.append(w)
            in_r, in_w, out_r, out_w, err_r, err_w = ends
            header = REQUEST.pack(MAGIC, len(payload), self.id, FLAG_IDLE if idle else 0,
                                  len(argv))
            socket.send_fds(self.sock, [header], [in_r, out_w, err_w])
            self.sock.sendall(payload)
            for fd in (in_r, out_w, err_w):
                os.close(fd)
            mine = [in_w, out_r, err_r]
            ends = []
            kind, _, rid, pid, err = self._reply()
            if kind == FORK_FAILED:
                raise ChannelError(f"the sandbox could not fork the command: "
                                   f"{os.strerror(err)}", err)
            if kind != STARTED or rid != self.id:
                raise ChannelError("the sandbox's init refused the command")
            self.pid = pid  # in the sandbox's PID namespace
        except BaseException:
            for fd in ends + mine:
                os.close(fd)
            self.sock.close()
            raise
        self.stdin: IO[bytes] | _Stream = _Stream(mine[0])
        self.stdout: IO[bytes] | _Stream = _Stream(mine[1])
        self.stderr: IO[bytes] | _Stream = _Stream(mine[2])

    def _reply(self) -> tuple[int, int, int, int, int]:
        buf = b""
        while len(buf) < REPLY.size:
            try:
                chunk = self.sock.recv(REPLY.size - len(buf))
            except TimeoutError:
                raise subprocess.TimeoutExpired("exec", self.sock.gettimeout() or 0) from None
            except OSError as e:
                raise ChannelError(f"the exec channel broke: {e}") from e
            if not chunk:
                raise ChannelError("the sandbox's init went away")
            buf += chunk
        kind, value, rid, pid, err = REPLY.unpack(buf)
        return kind, value, rid, pid, err

    def wait(self, timeout: float | None = None) -> int:
        """The command's exit code as a shell reports it (128+N for signal N,
        127 when it could not be started)."""
        if self.returncode is not None:
            return self.returncode
        self.sock.settimeout(timeout)
        try:
            kind, status, rid, _, err = self._reply()
        except ChannelError:
            self.returncode = 128 + 9  # init died: the sandbox was killed
            self.sock.close()
            return self.returncode
        if kind != EXITED or rid != self.id:
            raise ChannelError("the exec channel answered out of turn")
        self.exec_errno = err
        if err:
            self.returncode = 127
        elif os.WIFEXITED(status):
            self.returncode = os.WEXITSTATUS(status)
        else:
            self.returncode = 128 + os.WTERMSIG(status)
        self.sock.close()
        return self.returncode

    def kill(self) -> None:
        self._on_kill()

    def close(self) -> None:
        for s in (self.stdin, self.stdout, self.stderr):
            s.close()
        self.sock.close()


def host_pid(candidates: list[int], ns_pid: int) -> int | None:
    """The host pid of the process that is `ns_pid` in the sandbox's PID
    namespace, among `candidates` (the sandbox's cgroup members)."""
    for pid in candidates:
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"NSpid:"):
                        if int(line.split()[-1]) == ns_pid:
                            return pid
                        break
        except (OSError, ValueError):
            continue
    return None
