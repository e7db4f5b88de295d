"""The host's side of the guest agent's protocol (runtime/native/guest-agent.c
has the frame table): length-prefixed binary frames over a virtio-serial
port, which QEMU exposes on the host as a Unix socket.

Everything the guest sends is untrusted: frame sizes are checked before
anything is read, every field is parsed with struct (no pickle, no eval),
output is capped on the host too, and every wait has a deadline. A guest
that stops answering, answers out of step or goes away raises AgentError and
leaves the connection `broken`: later calls fail at once rather than read a
stale reply.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..backends.procio import ready
from ..errors import FileError, SandboxError, SandboxStateError
from .upper import UpperRefused, UpperTree, shown

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 20
CHUNK = 1 << 16
HEADER = struct.Struct("<II")  # payload length; type | request id << 8
MAX_ID = (1 << 24) - 1
CALL_TIMEOUT = 60.0
MIN_RATE = 1 << 20  # bytes/s a file read may not fall below, for its deadline
MAX_NAME = 255  # a directory entry's name (NAME_MAX)
MAX_ENTRIES = 100_000  # a listing (as runtime.files.MAX_LIST)
EXEC_GRACE = 30.0  # past an exec's own timeout, for the guest to kill and report

EXEC, DATA, KILL, READ, WRITE, LIST, REMOVE, STAT, PING, SHUTDOWN, UPPER, COUNTS = range(1, 13)
READY, STDOUT, STDERR, EXIT, FDATA, ENTRY, OK, ERROR = range(32, 40)

Sink = Callable[[bytes], None]


class AgentError(SandboxError):
    """The guest agent did not answer in time, answered out of step, or the
    connection to it is gone."""


class AgentClosed(AgentError):
    """The connection to the guest agent closed: the VM is most likely exiting."""


CLOSED = "the guest agent's connection closed (the VM exited?)"


class _Late(Exception):
    """A soft deadline passed (the connection stays usable)."""


@dataclass
class ExitStatus:
    code: int
    timed_out: bool
    truncated: bool
    oom_killed: bool = False  # by the guest's OOM killer in the commands' cgroup
    unreaped: bool = False  # the agent could not reap it: the code (-1) means nothing


@dataclass(frozen=True)
class GuestCounts:
    """What the guest kernel refused the commands' cgroup so far, as the
    agent read its counters (memory.events oom_kill, pids.events max)."""
    oom_kills: int
    fork_refusals: int


class RequestDropped(AgentError):
    """The agent gave up the request under way (its READY names it): it saw
    the host's end of the port closed. The channel is in step (the agent is
    back waiting for requests); the request's effect is unknown."""


def ready_fields(payload: bytes) -> tuple[str, int]:
    """A READY frame's version and the id of the request the agent dropped
    (0: none; an agent before version 3 sends the version alone)."""
    version, nul, rest = payload.partition(b"\0")
    dropped = struct.unpack("<I", rest)[0] if nul and len(rest) == 4 else 0
    return version.decode(errors="replace"), dropped


@dataclass
class Entry:
    name: str
    mode: int
    size: int
    mtime_ns: int


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def _header(length: int, kind: int, rid: int) -> bytes:
    return HEADER.pack(length, kind | rid << 8)


class AgentConnection:
    """One connection to one guest agent. Calls are serialized (the agent
    serves one request at a time)."""

    def __init__(self, sock: socket.socket, *, alive: Callable[[], bool] = lambda: True) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.alive = alive  # False once the VMM has exited: stop waiting
        self.lock = threading.Lock()
        self.broken: str | None = None
        self._buf = bytearray()
        self.version = ""
        # the id of the request under way; every reply frame carries it. A new
        # connection starts anywhere: a READY naming a request an earlier
        # connection's agent gave up must not name one of this connection's
        self._rid = secrets.randbelow(MAX_ID)
        # a COUNTS the host stopped waiting for: its one reply frame, when it
        # comes, is dropped (never taken for another request's)
        self._stale: int | None = None

    @classmethod
    def connect(cls, path: str, *, alive: Callable[[], bool] = lambda: True) -> AgentConnection:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.connect(path)
        except OSError:
            s.close()
            raise
        return cls(s, alive=alive)

    def close(self) -> None:
        self.broken = self.broken or "closed"
        try:
            self.sock.close()
        except OSError:
            pass

    # -- frames --------------------------------------------------------------
    def _fail(self, why: str, closed: bool = False) -> AgentError:
        self.broken = why
        return AgentClosed(why) if closed else AgentError(why)

    def _send(self, kind: int, payload: bytes = b"", deadline: float | None = None) -> None:
        if len(payload) > MAX_FRAME:
            raise ValueError(f"frame of {len(payload)} bytes")
        if kind not in (DATA, KILL):  # a new request: a new id
            self._rid = self._rid % MAX_ID + 1
        data = memoryview(_header(len(payload), kind, self._rid) + payload)
        deadline = deadline or time.monotonic() + CALL_TIMEOUT
        while data:
            try:
                n = self.sock.send(data)
                data = data[n:]
                continue
            except BlockingIOError:
                pass
            except OSError as e:
                raise self._fail(f"the guest agent's connection failed: {e}") from e
            left = deadline - time.monotonic()
            if left <= 0 or not self.alive():
                raise self._fail("the guest agent stopped reading its requests")
            ready([], [self.sock], min(left, 0.5))

    def _fill(self, n: int, deadline: float, soft: bool = False) -> None:
        while len(self._buf) < n:
            try:
                data = self.sock.recv(max(CHUNK, n - len(self._buf)))
                if not data:
                    raise self._fail(CLOSED, closed=True)
                self._buf += data
                continue
            except BlockingIOError:
                pass
            except OSError as e:
                raise self._fail(f"the guest agent's connection failed: {e}") from e
            left = deadline - time.monotonic()
            if left <= 0:
                if soft:
                    raise _Late()
                raise self._fail("the guest agent did not answer in time")
            if not self.alive():
                raise self._fail("the VM exited")
            ready([self.sock], timeout=min(left, 0.5))

    def _frame(self) -> tuple[int, bytes] | None:
        """A whole frame from what has been received, if there is one (a
        stale request's reply is dropped: None)."""
        if len(self._buf) < HEADER.size:
            return None
        length, kind, stale = self._parse()
        if len(self._buf) < HEADER.size + length:
            return None
        payload = bytes(self._buf[HEADER.size:HEADER.size + length])
        del self._buf[:HEADER.size + length]
        return None if stale else (kind, payload)

    def _exchange(self, pending: memoryview, deadline: float) -> tuple[memoryview, bool]:
        """Send what of `pending` the socket takes and receive what arrived,
        waiting for either; returns the rest of pending and whether a whole
        frame is ready. Lets stdin flow while output comes back (sending all
        stdin first deadlocks once both directions fill)."""
        while True:
            if self._frame_ready():
                return pending, True
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail("the guest agent did not answer in time")
            if not self.alive():
                raise self._fail("the VM exited")
            r, w = ready([self.sock], [self.sock] if pending else [], min(left, 0.5))
            try:
                if w:
                    pending = pending[self.sock.send(pending):]
                if r:
                    data = self.sock.recv(max(CHUNK, 1 << 16))
                    if not data:
                        raise self._fail(CLOSED, closed=True)
                    self._buf += data
            except BlockingIOError:
                pass
            except OSError as e:
                raise self._fail(f"the guest agent's connection failed: {e}") from e

    def _parse(self) -> tuple[int, int, bool]:
        """Length and type of the frame at the head of the buffer, and
        whether it is the one reply of a stale COUNTS (to drop); refusing
        one that answers another request than the one under way."""
        length, word = HEADER.unpack_from(self._buf)
        kind, rid = word & 0xFF, word >> 8
        if length > MAX_FRAME:
            raise self._fail(f"the guest agent sent a frame of {length} bytes "
                             f"(at most {MAX_FRAME}): out of step")
        if kind == READY:
            if rid != 0:
                raise self._fail("the guest agent sent a READY frame with a request id")
        elif rid == self._stale and rid != self._rid:
            if kind not in (OK, ERROR) or length > 4096:
                raise self._fail(f"the guest agent sent frame {kind} for a counts request: "
                                 "out of step")
            if len(self._buf) >= HEADER.size + length:
                self._stale = None  # its whole reply: dropped by the caller
            return length, kind, True
        elif rid != self._rid:
            raise self._fail(f"the guest agent answered request {rid} during request "
                             f"{self._rid}: out of step")
        return length, kind, False

    def _frame_ready(self) -> bool:
        if len(self._buf) < HEADER.size:
            return False
        length: int = HEADER.unpack_from(self._buf)[0]
        return length > MAX_FRAME or len(self._buf) >= HEADER.size + length

    def recv(self, deadline: float, soft: bool = False) -> tuple[int, bytes]:
        while True:
            self._fill(HEADER.size, deadline, soft)
            length, kind, stale = self._parse()
            self._fill(HEADER.size + length, deadline, soft)
            if stale:
                self._parse()  # now whole: clears the stale id
            payload = bytes(self._buf[HEADER.size:HEADER.size + length])
            del self._buf[:HEADER.size + length]
            if not stale:
                return kind, payload

    def reply(self, deadline: float, soft: bool = False) -> tuple[int, bytes]:
        """The next frame answering the request under way. READY frames are
        not answers: the agent sends one whenever it saw the host's end of
        the port close and open again (for a moment when a VM is restored
        from a snapshot, at any time in its next call), so one may come
        before or among any request's frames; it is skipped, unless it says
        the agent dropped this very request (RequestDropped: no more frames
        will come for it, and waiting would only run into the deadline)."""
        while True:
            kind, payload = self.recv(deadline, soft)
            if kind != READY:
                return kind, payload
            self.version, dropped = ready_fields(payload)
            log.info("the guest agent greeted again during request %d (dropped: %d)",
                     self._rid, dropped)
            if dropped and dropped == self._rid:
                raise RequestDropped(f"the guest agent gave up request {dropped} (it saw the "
                                     "host's end of its port close)")

    def _check(self) -> None:
        if self.broken is not None:
            raise AgentError(f"the guest agent is unusable: {self.broken}")

    def _reply(self, deadline: float, what: str) -> None:
        """Wait for OK; ERROR raises FileError with the guest's message."""
        kind, payload = self.reply(deadline)
        if kind == OK:
            return
        if kind == ERROR:
            raise _file_error(payload, what)
        raise self._fail(f"unexpected frame {kind} in reply to {what}")

    # -- ready ---------------------------------------------------------------
    def wait_ready(self, deadline: float) -> str:
        """Wait for the agent's READY frame (sent on every new connection)."""
        with self.lock:
            while True:
                kind, payload = self.recv(deadline)
                if kind == READY:
                    self.version = ready_fields(payload)[0]
                    return self.version

    def ping(self, timeout: float = 10.0) -> None:
        """Round trip; READY frames (the agent greets every new connection)
        are skipped, so this also syncs a fresh connection to a running VM."""
        with self.lock:
            self._check()
            deadline = time.monotonic() + timeout
            self._send(PING, deadline=deadline)
            kind, _ = self.reply(deadline)
            if kind != OK:
                raise self._fail(f"unexpected frame {kind} in reply to ping")

    # -- exec ----------------------------------------------------------------
    def exec(self, argv: tuple[str, ...], *, env: dict[str, str], cwd: str, stdin: bytes,
             timeout: float, max_output: int, on_stdout: Sink | None,
             on_stderr: Sink | None, grace: float = EXEC_GRACE
             ) -> tuple[ExitStatus, bytearray, bytearray]:
        """Run argv in the guest. The guest enforces timeout and max_output
        (killing the command's tree); the host gives up `grace` seconds
        after the timeout if no exit status came."""
        with self.lock:
            self._check()
            env_list = [f"{k}={v}" for k, v in env.items()]
            head = struct.pack("<IQIII", max(1, int(timeout * 1000)), max_output,
                               1 if stdin else 0, len(argv), len(env_list))
            body = head + _string(cwd) + b"".join(_string(a) for a in argv) + \
                b"".join(_string(e) for e in env_list)
            if len(body) > MAX_FRAME:
                raise SandboxError(f"command and environment take {len(body)} bytes; at most "
                                   f"{MAX_FRAME} fit an exec request")
            deadline = time.monotonic() + timeout + grace
            self._send(EXEC, body, deadline)
            frames = b"".join(_header(len(c), DATA, self._rid) + c for c in
                              (stdin[i:i + CHUNK] for i in range(0, len(stdin), CHUNK)))
            pending = memoryview(frames + (_header(0, DATA, self._rid) if stdin else b""))
            out, err = bytearray(), bytearray()
            while True:
                pending, _ = self._exchange(pending, deadline)
                frame = self._frame()
                if frame is None:  # a stale counts reply, dropped
                    continue
                kind, payload = frame
                if kind in (STDOUT, STDERR):
                    buf, sink = (out, on_stdout) if kind == STDOUT else (err, on_stderr)
                    room = max_output - len(buf)
                    if len(payload) > room:
                        raise self._fail("the guest agent sent more output than the cap")
                    buf += payload
                    if sink is not None and payload:
                        sink(payload)
                elif kind == EXIT and len(payload) == 8:
                    code, flags = struct.unpack("<iI", payload)
                    return ExitStatus(code, bool(flags & 1), bool(flags & 2), bool(flags & 4),
                                      bool(flags & 8)), out, err
                elif kind == ERROR:
                    _, msg = _error_fields(payload)
                    raise SandboxError(f"the guest agent could not run {argv[0]!r}: {msg}")
                elif kind == READY:  # see reply(): skipped, unless it dropped this exec
                    self.version, dropped = ready_fields(payload)
                    log.info("the guest agent greeted again during exec request %d "
                             "(dropped: %d)", self._rid, dropped)
                    if dropped and dropped == self._rid:
                        # the agent killed the command and sent no EXIT: its
                        # status is unknown (never a made-up code)
                        return ExitStatus(-1, False, False, False, True), out, err
                else:
                    raise self._fail(f"unexpected frame {kind} during exec")

    # -- files ---------------------------------------------------------------
    def read(self, path: str, limit: int) -> bytes:
        with self.lock:
            self._check()
            self._send(READ, struct.pack("<Q", limit) + _string(path))
            # one deadline for the whole read, sized by the limit: a guest
            # trickling (or sending empty) frames cannot hold the VM's lock
            deadline = time.monotonic() + CALL_TIMEOUT + limit / MIN_RATE
            data = bytearray()
            while True:
                kind, payload = self.reply(deadline)
                if kind == FDATA:
                    if len(data) + len(payload) > limit:
                        raise self._fail(f"{path}: the guest sent more than {limit} bytes")
                    data += payload
                elif kind == OK:
                    return bytes(data)
                elif kind == ERROR:
                    raise _file_error(payload, path)
                else:
                    raise self._fail(f"unexpected frame {kind} reading {path}")

    def write(self, path: str, data: bytes, mode: int) -> None:
        with self.lock:
            self._check()
            deadline = time.monotonic() + CALL_TIMEOUT + len(data) / (10 << 20)
            self._send(WRITE, struct.pack("<I", mode) + _string(path), deadline)
            for i in range(0, len(data), CHUNK):
                self._send(DATA, data[i:i + CHUNK], deadline)
            self._send(DATA, b"", deadline)
            self._reply(deadline, path)

    def list(self, path: str) -> list[Entry]:
        with self.lock:
            self._check()
            self._send(LIST, _string(path))
            deadline = time.monotonic() + CALL_TIMEOUT
            out: list[Entry] = []
            while True:
                kind, payload = self.reply(deadline)
                if kind == ENTRY and len(payload) >= 24:
                    mode, size, mtime, n = struct.unpack_from("<IQqI", payload)
                    raw = payload[24:]
                    if n != len(raw) or not 0 < n <= MAX_NAME or raw in (b".", b"..") \
                            or b"/" in raw or b"\0" in raw:
                        raise self._fail("malformed directory entry from the guest")
                    if len(out) >= MAX_ENTRIES:
                        raise self._fail(f"{path}: more than {MAX_ENTRIES} entries (the guest "
                                     "agent should have stopped)")
                    out.append(Entry(raw.decode(errors="surrogateescape"), mode, size, mtime))
                elif kind == OK:
                    return out
                elif kind == ERROR:
                    if _error_fields(payload)[0] == errno.E2BIG:  # the agent's cap
                        raise FileError(f"{path}: more than {MAX_ENTRIES} entries")
                    raise _file_error(payload, path)
                else:
                    raise self._fail(f"unexpected frame {kind} listing {path}")

    def remove(self, path: str, recursive: bool) -> None:
        with self.lock:
            self._check()
            self._send(REMOVE, struct.pack("<I", int(recursive)) + _string(path))
            self._reply(time.monotonic() + CALL_TIMEOUT, path)

    def exists(self, path: str) -> bool:
        with self.lock:
            self._check()
            self._send(STAT, _string(path))
            try:
                self._reply(time.monotonic() + CALL_TIMEOUT, path)
            except FileError:
                return False
            return True

    # -- the upper (verify) ----------------------------------------------------
    def upper(self, tree: UpperTree, *, lock_wait: float) -> None:
        """Stream the guest's writable upper into `tree` (runtime/guest/upper.py
        has the stream and what is refused), the guest's processes stopped
        meanwhile (the agent's SIGSTOP, SIGCONT after). The guest's own
        refusal (its bounds, an upper it cannot read) raises UpperRefused and
        keeps the connection in step; a stream breaking the host's rules
        raises UpperRefused and leaves the connection broken (out of step:
        the rest of the stream is not read). One deadline for the whole call,
        sized by the bounds."""
        if not self.lock.acquire(timeout=lock_wait):
            raise SandboxStateError("it is running a command or a file call; verify it "
                                    "once that ends")
        try:
            self._check()
            self._send(UPPER, struct.pack("<QI", tree.max_bytes, tree.max_entries))
            deadline = time.monotonic() + CALL_TIMEOUT + tree.max_bytes / MIN_RATE + \
                tree.max_entries / 1000
            while True:
                kind, payload = self.reply(deadline)
                try:
                    if kind == FDATA:
                        tree.data(payload)
                        continue
                    if kind == ERROR:  # also in the middle of a file: it stopped there
                        _, msg = _error_fields(payload)
                        raise UpperRefused(f"the guest agent refused: {shown(msg, 300)}")
                    if tree.expecting:
                        raise UpperRefused(f"a frame of type {kind} where "
                                           f"{tree.expecting} bytes of file data were due")
                    if kind == ENTRY:
                        tree.entry(payload)
                    elif kind == OK:
                        tree.finish()
                        return
                    else:
                        raise UpperRefused(f"unexpected frame {kind}")
                except UpperRefused as e:
                    if kind != ERROR:
                        self.broken = f"refused the guest's upper stream: {e}"
                    raise
        finally:
            self.lock.release()

    def counts(self, wait: float, timeout: float = 10.0) -> GuestCounts | None:
        """The guest's counters now; None when the agent has no commands'
        cgroup, is busy with another call (an exec holds the channel) for
        longer than `wait`, or does not answer within `timeout` (a slow
        guest: its late reply is dropped when it comes, the connection
        stays usable, and no other counts is asked until then)."""
        if not self.lock.acquire(timeout=wait):
            return None
        try:
            self._check()
            if self._stale is not None:
                return None
            deadline = time.monotonic() + timeout
            self._send(COUNTS, deadline=deadline)
            try:
                kind, payload = self.reply(deadline, soft=True)
            except _Late:
                log.info("the guest agent did not answer counts request %d in %gs",
                         self._rid, timeout)
                self._stale = self._rid
                return None
            if kind == ERROR:
                return None
            if kind != OK or len(payload) != 16:
                raise self._fail(f"unexpected frame {kind} ({len(payload)} bytes) in reply "
                                 "to counts")
            oom, forks = struct.unpack("<QQ", payload)
            return GuestCounts(oom, forks)
        finally:
            self.lock.release()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self.lock:
            self._check()
            self._send(SHUTDOWN)
            self._reply(time.monotonic() + timeout, "shutdown")


def _error_fields(payload: bytes) -> tuple[int, str]:
    if len(payload) < 4:
        return 0, "unknown error"
    (errno_,) = struct.unpack_from("<i", payload)
    return errno_, payload[4:4096].decode(errors="replace")


def _file_error(payload: bytes, path: str) -> FileError:
    _, msg = _error_fields(payload)
    # the agent says "<path>: <strerror>"; keep the host's path in front
    return FileError(f"{path}: {msg.rsplit(': ', 1)[-1]}")


def entry_kind(mode: int) -> str:
    return ("dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode)
            else "symlink" if stat.S_ISLNK(mode) else "other")


def socket_path_ok(path: str) -> bool:
    """Unix socket paths are limited to 107 bytes."""
    return len(os.fsencode(path)) < 108
