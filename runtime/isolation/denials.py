"""Denials as events: what a sandbox was refused, counted where
its caller (`sb.events()`, the node agent's `GET /v1/sandboxes/ID/events`,
`lazyfs sandbox events ID`) and the node's operator (one log line per new
kind of denial per sandbox) can see it. A denial never kills the sandbox: the
refused call fails as it would without the record.

Where each comes from:

- system calls the seccomp policy denies (runtime/isolation/seccomp.py): the filter
  answers them with a user notification instead of a plain errno; runc hands
  the notification descriptor of each sandbox to the node's listener (a unix
  socket in the node's state directory, the OCI `listenerPath`), and one
  thread of the node answers every sandbox's notifications with EPERM and
  counts them by system call. Should the node go away, the kernel answers
  ENOSYS instead: still refused, no longer recorded. fncall calls load the
  same policy per call (runtime/native/sandbox-init.c `call -N`): the call's
  listener goes to the node over its worker's feed socket before the
  command starts, and is answered by the same kind of thread.
- a command making a Landlock domain of its own with flags that would keep
  its refusals out of the audit log (runtime/isolation/seccomp.py
  UNLOGGED_LANDLOCK): notified the same way, recorded as `landlock`
  `restrict_self unlogged`, and let go on (not refused).
- Landlock's own refusals: runtime/isolation/landlock_audit.py.
- connections the network allowlist refuses: the reject rule adds each
  refused destination to an nftables set with counters inside the sandbox's
  network namespace (runtime/backends/netpolicy.py), read when asked for.
- OOM kills and forks refused at the pids limit: the kernel's counters of the
  sandbox's cgroups, read when asked for (fncall: of the worker's cgroup
  during the call, recorded when the call ends).

Events are counts per (kind, detail), with the first and last time seen;
at most MAX_DETAILS details per sandbox and kind (more are counted under
"other"), so a sandbox calling mount(2) in a loop costs the node a counter,
not memory.
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import functools
import json
import logging
import os
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import BackendUnavailable
from ..spec import SANDBOX_ID_PATTERN, EventKind, SandboxEvent
from . import landlock_audit

log = logging.getLogger(__name__)

MAX_DETAILS = 64
OTHER = "other"

# Each denied call is a round trip to the node's listener thread, on the
# node's CPU, not the sandbox's: a sandbox looping on a denied call would
# spend the node's time (measured: ~35,000 per second from one sandbox
# doubled a neighbour's exec latency). So answers are rationed: per sandbox
# a bucket of BURST refilled at RATE per second, and all sandboxes together
# ALL_RATE per second. A sandbox past its ration waits, inside its denied
# call, until its turn: only the flooding sandbox slows down.
RATE = 200.0
BURST = 1000.0
ALL_RATE = 4000.0

# <linux/seccomp.h>: _IOWR('!', 0, struct seccomp_notif) and
# _IOWR('!', 1, struct seccomp_notif_resp) on x86-64/aarch64
NOTIF = struct.Struct("<QII iIQ6Q")  # id, pid, flags, data{nr, arch, ip, args[6]}
NOTIF_RESP = struct.Struct("<QqiI")  # id, val, error, flags
SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1


class DenialLog:
    """Every sandbox's recorded denials, in memory (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_sandbox: dict[str, dict[tuple[EventKind, str], list[float]]] = {}

    def record(self, sandbox_id: str, kind: EventKind, detail: str, n: int = 1) -> None:
        now = time.time()
        with self._lock:
            seen = self._by_sandbox.setdefault(sandbox_id, {})
            key = (kind, detail)
            if key not in seen and sum(1 for k, _ in seen if k == kind) >= MAX_DETAILS:
                key = (kind, OTHER)
            entry = seen.get(key)
            if entry is None:
                seen[key] = [float(n), now, now]
                new = True
            else:
                entry[0] += n
                entry[2] = now
                new = False
        if new:
            log.warning("sandbox %s: %s denied (%s)", sandbox_id, kind, detail)

    def events(self, sandbox_id: str) -> list[SandboxEvent]:
        with self._lock:
            seen = dict(self._by_sandbox.get(sandbox_id, {}))
        return [SandboxEvent(kind=kind, detail=detail, count=int(c), first=first, last=last)
                for (kind, detail), (c, first, last) in sorted(seen.items())]

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._by_sandbox.pop(sandbox_id, None)


class Denials:
    """One backend's denials: their record (DenialLog), the node's seccomp
    listener of its sandboxes (started with the first), and Landlock's audit
    records (runtime/isolation/landlock_audit.py) routed to the live sandbox each
    names. The container and fncall backends have one each; they differ in
    where the listener listens (`path`: the unix socket runc hands each
    container's notification descriptor to; None: socket pairs, one per
    fncall worker, through `listener().feed`) and in how a record's host
    uid and pid name a sandbox (`whose`: its id, or None when they cannot
    tell). A refusal of a sandbox is recorded from `watch(id)` until
    `forget(id)`."""

    def __init__(self, whose: Callable[[int, int | None], str | None],
                 path: Path | None = None) -> None:
        self.log = DenialLog()
        self._whose, self._path = whose, path
        self._lock = threading.Lock()
        self._listener: SeccompListener | None = None
        self._audit: landlock_audit.AuditListener | None = None
        self._auditing = False
        self._live: set[str] = set()

    def listener(self) -> SeccompListener:
        """The node's end of the sandboxes' seccomp notifications."""
        with self._lock:
            if self._listener is None:
                if self._path is not None and len(os.fsencode(self._path)) >= 100:
                    raise BackendUnavailable("the state directory's path is too long for a "
                                             f"unix socket: {self._path}")
                self._listener = SeccompListener(self._path, self.log)
                self._start_audit()
            return self._listener

    def _start_audit(self) -> None:  # (under self._lock)
        if not self._auditing:
            self._auditing = True
            self._audit = landlock_audit.acquire(self._sink)

    @property
    def audit(self) -> landlock_audit.AuditListener | None:
        """The audit reader this backend's refusals come through (None: not
        started, or the kernel's audit cannot be read here)."""
        return self._audit

    def start_audit(self) -> None:
        with self._lock:
            self._start_audit()

    def stop_audit(self) -> None:
        """Leave the audit reader (the last one out stops it)."""
        with self._lock:
            auditing, self._auditing, self._audit = self._auditing, False, None
        if auditing:  # not under the lock: the audit thread may want it
            landlock_audit.release(self._sink)

    def watch(self, sandbox_id: str) -> None:
        """Record the sandbox's refusals from now on (its create, or a node
        that adopts it running: Node.recover)."""
        with self._lock:
            self._live.add(sandbox_id)
            self._start_audit()

    def record(self, sandbox_id: str, kind: EventKind, detail: str, n: int = 1) -> None:
        self.log.record(sandbox_id, kind, detail, n)

    def events(self, sandbox_id: str) -> list[SandboxEvent]:
        return self.log.events(sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: its record goes, and nothing more is recorded."""
        with self._lock:
            self._live.discard(sandbox_id)
            listener = self._listener
        self.log.forget(sandbox_id)
        if listener is not None:
            listener.forget(sandbox_id)

    def _sink(self, uid: int, pid: int | None) -> landlock_audit.Sink | None:
        sandbox_id = self._whose(uid, pid if pid is not None and pid > 0 else None)
        return None if sandbox_id is None else functools.partial(self._landlock, sandbox_id)

    def _landlock(self, sandbox_id: str, kind: str, detail: str) -> None:
        """A Landlock refusal of the sandbox, unless it was killed since."""
        with self._lock:
            if sandbox_id not in self._live:
                return
        self.log.record(sandbox_id, kind, detail)  # type: ignore[arg-type]

    def close(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        self.stop_audit()


def merged(recorded: list[SandboxEvent], counted: dict[tuple[EventKind, str], int]
           ) -> list[SandboxEvent]:
    """Recorded events plus kernel counters read now ((kind, detail) -> count;
    zero counts dropped), in one sorted list."""
    now = time.time()
    out = {(e.kind, e.detail): e for e in recorded}
    for (kind, detail), n in counted.items():
        if n <= 0:
            continue
        old = out.get((kind, detail))  # counted under an earlier rule set too
        out[(kind, detail)] = SandboxEvent(kind=kind, detail=detail, count=n, first=None,
                                           last=now) if old is None else \
            old.model_copy(update={"count": old.count + n, "last": now})
    return sorted(out.values(), key=lambda e: (e.kind, e.detail))


class _Bucket:
    """A token bucket: take() is the time to wait before the next token."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.at = burst, time.monotonic()

    def take(self, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return (1.0 - self.tokens) / self.rate
        self.tokens -= 1.0
        return 0.0

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.at) * self.rate >= self.burst


# the node's ration: one for every listener of the process (the container
# and fncall backends each have one), so two backends do not double it
_ALL = _Bucket(ALL_RATE, ALL_RATE)
_ALL_LOCK = threading.Lock()
_SANDBOX_ID = re.compile(SANDBOX_ID_PATTERN)


class SeccompListener:
    """The node's end of every sandbox's seccomp notifications (answers
    rationed per sandbox: RATE, BURST; all together ALL_RATE).

    Listener descriptors arrive two ways: from runc, over the unix socket at
    `path` (one connection per container, the OCI state naming it), and over
    feeds (feed()): a connected socket on which an fncall worker's
    sandbox-init sends, per call, the sandbox's id with the call's listener."""

    def __init__(self, path: Path | None, denials: DenialLog) -> None:
        self.path = path
        self.denials = denials
        self._poll = select.epoll()  # O(1) per wake however many sandboxes
        self._sandbox_of: dict[int, str] = {}
        self._fds_of: dict[str, set[int]] = {}
        # per sandbox, not per descriptor: an fncall sandbox gets a listener
        # per call, and its ration must not start afresh with each
        self._buckets: dict[str, _Bucket] = {}
        self._pruned = time.monotonic()
        self._held: dict[int, float] = {}  # fd -> when it may be answered again
        self._feeds: dict[int, socket.socket] = {}
        self._stop_r, self._stop_w = os.pipe()
        self._sock: socket.socket | None = None
        if path is not None:
            path.unlink(missing_ok=True)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # mode 0600 from the socket itself: a umask saved and restored
            # here raced other threads' and could stay 0177 for the process
            os.fchmod(self._sock.fileno(), 0o600)
            self._sock.bind(str(path))
            self._sock.listen(128)
            self._poll.register(self._sock.fileno(), select.EPOLLIN)
        self._poll.register(self._stop_r, select.EPOLLIN)
        self._syscall_name = _syscall_names()
        self._lock = threading.Lock()  # feed() and forget() from other threads
        self._thread = threading.Thread(target=self._serve, name="seccomp-notify", daemon=True)
        self._thread.start()

    def feed(self, sock: socket.socket) -> None:
        """Take `sock` (a connected SOCK_SEQPACKET socket; closed here once
        its peer is gone): each message on it is a sandbox id with one
        listener descriptor. Only code of ours writes there (the fncall
        worker and its sandbox-init before the call's command starts)."""
        sock.setblocking(False)
        with self._lock:
            self._feeds[sock.fileno()] = sock
            self._poll.register(sock.fileno(), select.EPOLLIN)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: its ration too."""
        with self._lock:
            if not self._fds_of.get(sandbox_id):
                self._buckets.pop(sandbox_id, None)

    def _serve(self) -> None:
        while True:
            timeout = -1.0
            if self._held:
                now = time.monotonic()
                for fd, at in list(self._held.items()):
                    if at <= now:
                        del self._held[fd]
                        self._poll.modify(fd, select.EPOLLIN)
                if self._held:
                    timeout = max(0.0, min(self._held.values()) - now)
            for fd, ev in self._poll.poll(timeout):
                if fd == self._stop_r:
                    return
                try:
                    with self._lock:
                        if self._sock is not None and fd == self._sock.fileno():
                            self._accept()
                        elif fd in self._feeds:
                            self._from_feed(fd, ev)
                        elif ev & (select.EPOLLHUP | select.EPOLLERR):
                            self._drop(fd)  # every process under the filter is gone
                        elif fd in self._sandbox_of:
                            self._answer(fd)
                except OSError as e:  # one sandbox's trouble must not stop the others'
                    log.warning("seccomp notifications: %s", e)

    def _accept(self) -> None:
        assert self._sock is not None
        conn, _ = self._sock.accept()
        with conn:
            conn.settimeout(5)
            msg, fds = recv_fds_cloexec(conn, 1 << 16, 4)
        try:
            state = json.loads(msg)
            sandbox_id = str(state["state"]["id"])
        except (ValueError, KeyError, TypeError):
            for fd in fds:
                os.close(fd)
            raise OSError("runc sent an unreadable container state") from None
        for fd in fds:
            self._register(fd, sandbox_id)

    def _from_feed(self, feed: int, ev: int) -> None:
        try:
            msg, fds = recv_fds_cloexec(self._feeds[feed], 256, 1)
        except BlockingIOError:
            if not ev & (select.EPOLLHUP | select.EPOLLERR):
                return
            msg, fds = b"", []
        if not msg and not fds:  # the worker is gone
            self._poll.unregister(feed)
            self._feeds.pop(feed).close()
            return
        key = msg.decode(errors="replace")
        if not _SANDBOX_ID.fullmatch(key) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(f"a feed sent {len(fds)} descriptors with {key[:40]!r}")
        self._register(fds[0], key)

    def _register(self, fd: int, sandbox_id: str) -> None:
        now = time.monotonic()
        if now - self._pruned > 1.0:  # rations of sandboxes without listeners, refilled
            self._pruned = now
            for sid in [s for s, b in self._buckets.items()
                        if not self._fds_of.get(s) and b.full(now)]:
                del self._buckets[sid]
        self._sandbox_of[fd] = sandbox_id
        self._fds_of.setdefault(sandbox_id, set()).add(fd)
        self._buckets.setdefault(sandbox_id, _Bucket(RATE, BURST))
        self._poll.register(fd, select.EPOLLIN)

    def _drop(self, fd: int) -> None:
        self._poll.unregister(fd)
        sid = self._sandbox_of.pop(fd, None)
        if sid is not None:
            fds = self._fds_of.get(sid, set())
            fds.discard(fd)
            if not fds:
                self._fds_of.pop(sid, None)
        self._held.pop(fd, None)
        os.close(fd)

    def _answer(self, fd: int) -> None:
        now = time.monotonic()
        sid = self._sandbox_of[fd]
        bucket = self._buckets.setdefault(sid, _Bucket(RATE, BURST))
        wait = bucket.take(now)
        if not wait:
            with _ALL_LOCK:
                wait = _ALL.take(now)
            if wait:  # give the sandbox's token back: the node's ration ran out
                bucket.tokens += 1.0
        if wait:  # not now: stop watching it until its turn (EPOLLHUP still comes)
            self._held[fd] = now + wait
            self._poll.modify(fd, 0)
            return
        buf = bytearray(NOTIF.size)
        try:
            fcntl.ioctl(fd, SECCOMP_IOCTL_NOTIF_RECV, buf)
        except OSError as e:
            if e.errno != errno.ENOENT:  # ENOENT: the caller died meanwhile
                self._drop(fd)
            return
        nid, _, _, nr, arch, *_ = NOTIF.unpack(buf)
        name = self._syscall_name(arch, nr)
        # a Landlock domain made without audit logging (seccomp.UNLOGGED_LANDLOCK):
        # recorded, and let go on (its flags are a register: nothing to race)
        go_on = name == "landlock_restrict_self"
        try:
            fcntl.ioctl(fd, SECCOMP_IOCTL_NOTIF_SEND,
                        NOTIF_RESP.pack(nid, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE) if go_on
                        else NOTIF_RESP.pack(nid, 0, -errno.EPERM, 0))
        except OSError:
            pass  # the caller died before the answer
        if go_on:
            self.denials.record(sid, "landlock", "restrict_self unlogged")
        else:
            self.denials.record(sid, "syscall", name)

    def close(self) -> None:
        if self._poll.closed:
            return
        os.write(self._stop_w, b"x")
        self._thread.join(5)
        for fd in self._sandbox_of:
            os.close(fd)
        for sock in self._feeds.values():
            sock.close()
        self._sandbox_of.clear()
        self._feeds.clear()
        if self._sock is not None:
            self._sock.close()
        self._poll.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def recv_fds_cloexec(conn: socket.socket, bufsize: int, maxfds: int
                     ) -> tuple[bytes, list[int]]:
    """A message and the descriptors passed with it, close-on-exec from the
    start. socket.recv_fds ignores its flags, and a received descriptor is
    otherwise inheritable: every runc and nsenter the node starts inherited
    one per sandbox on the node (runc then marked each close-on-exec itself,
    a create's cost growing with the sandboxes), and a descriptor set
    inheritable afterwards could leak to a process spawned meanwhile."""
    fds = array.array("i")
    msg, ancdata, _, _ = conn.recvmsg(bufsize, socket.CMSG_LEN(maxfds * fds.itemsize),
                                      socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def _syscall_names() -> Callable[[int, int], str]:
    import pyseccomp  # imported late: only a node that runs containers needs it

    def name(arch: int, nr: int) -> str:
        try:
            return bytes(pyseccomp.resolve_syscall(arch, nr)).decode()
        except (ValueError, OSError, ctypes.ArgumentError, TypeError):
            return f"syscall {nr}"
    return name
