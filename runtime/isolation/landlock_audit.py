"""Landlock denials as events: the node reads the kernel's audit records of
Landlock (ABI 7+) and counts each denial on the sandbox it came from.

Every Landlock domain of ours is made with LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON
(runtime/native/sandbox-init.c): a container command's own domain (which
scopes ptrace-class access and signals to the command's process tree) and an
fncall call's (file and TCP rules). The kernel then writes one
AUDIT_LANDLOCK_ACCESS record per refused access (`domain=ID blockers=WHAT
...`), and the first time a domain shows, an AUDIT_LANDLOCK_DOMAIN record
naming the process that made it (`status=allocated ... pid=N uid=N ...`);
when a logged domain is freed, `status=deallocated`.

Records exist only while the kernel's audit is enabled, a host setting: a
node turns it on if it is off (AUDIT_SET enabled=1, never the auditd pid: the
node does not become the host's audit daemon), caps it at KERNEL_RATE records
a second if it had no rate limit, and leaves OWNER_MARK (the old rate
limit); the last reader of the host to stop (no other socket bound to the
group, /proc/net/netlink) restores both if the mark is there. The records
are read from the audit netlink socket's read-only multicast group
(AUDIT_NLGRP_READLOG, CAP_AUDIT_READ), one thread for all sandboxes.

Records name host ids, not sandboxes. A domain's creator's uid (in its
DOMAIN record) or the refused process's uid (in the SYSCALL record of the
same event, when the process has an audit context) is a sandbox's own: a
container's user namespace maps it to a host range of its own
(runtime/isolation/idmap.py), an fncall call runs as its sandbox's uid
(hostlimits.fncall_uid; sandbox-init takes it before it makes the domain).
Each backend registers a resolver (uid, pid) -> the sandbox's sink (kind,
detail); where the uid cannot tell (no user namespaces, a range restores
share), the cgroup of the refused process, or of the process a refused
ptrace or signal reached for (uid -1), decides. A domain is mapped once;
later records of it use the map. (A command's own domain made so that its
refusals would not be logged is recorded by the seccomp policy:
runtime/isolation/seccomp.py UNLOGGED_LANDLOCK.)

Kinds: a refused ptrace-class access (ptrace, /proc/PID/fd and mem,
pidfd_getfd, process_vm_writev: `ptrace`) or a refused signal or abstract
socket (`scope.*`) is `tampering`: in a container it can only be a process
of one command reaching for another's. File and network rules (`fs.*`,
`net.*`, fncall) are `landlock`. The detail is the kernel's blockers list,
never a path or name the sandbox chose.

Bounds: the kernel formats each record in the refused process's context,
drops it past its `rate_limit` a second (a node that turns audit on sets
KERNEL_RATE if there was none, and restores it), queues at most
`backlog_limit` (64 by default; more are lost, counted by the kernel) and,
with no auditd, also prints it to the kernel log under printk_ratelimit (10
lines per 5 s by default, the rest suppressed). The
listener handles at most RATE records a second (BURST at once); past that it
stops reading, the socket's buffer fills and the kernel drops what does not
fit (counted as lost here): a sandbox flooding denials costs the node a
bounded share of one thread, and its counts become lower bounds.
"""

from __future__ import annotations

import collections
import errno
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
from dataclasses import dataclass, field
from pathlib import Path

from . import landlock

log = logging.getLogger(__name__)

NETLINK_AUDIT = 9
AUDIT_NLGRP_READLOG = 1
AUDIT_GET, AUDIT_SET = 1000, 1001
AUDIT_SYSCALL, AUDIT_EOE = 1300, 1320
AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN = 1423, 1424
AUDIT_STATUS_ENABLED, AUDIT_STATUS_RATE_LIMIT = 1, 8
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
STATUS = struct.Struct("=10I")  # struct audit_status (the fields up to backlog_wait_time_actual)

# made by the node that turned the kernel's audit on (and removed by the one
# that turns it off): the last node of the host to stop restores it, whichever
# node (process) turned it on
OWNER_MARK = Path("/run/lazyfs-audit-enabled")

RATE = 2000.0  # records handled a second, all sandboxes together
KERNEL_RATE = 2000  # the kernel's audit rate limit a node sets when it turns audit on
BURST = 4000.0
RCVBUF = 1 << 20
MAX_DOMAINS = 1 << 16  # mapped domains kept (freed ones are dropped when the kernel says so)
PENDING_AGE = 2.0  # seconds an unmapped access record waits for its domain's records

# what the kernel writes first in each record is its own: the sandbox's
# strings (paths, comm, exe) come later, escaped; only these prefixes are read
_HEADER = re.compile(rb"audit\((\d{1,20})\.(\d{1,9}):(\d{1,20})\): ")
_ACCESS = re.compile(rb"domain=([0-9a-f]{1,16}) blockers=([a-z_]{1,32}(?:\.[a-z_]{1,32})?"
                     rb"(?:,[a-z_]{1,32}(?:\.[a-z_]{1,32})?){0,31})(?: opid=(\d{1,10}) | |\x00|\Z)")
_ALLOCATED = re.compile(rb"domain=([0-9a-f]{1,16}) status=allocated mode=[a-z]{1,16} "
                        rb"pid=(\d{1,10}) uid=(\d{1,10}) ")
_DEALLOCATED = re.compile(rb"domain=([0-9a-f]{1,16}) status=deallocated ")
_SYSCALL = re.compile(rb"arch=[0-9a-f]{1,8} syscall=\d{1,5} (?:[a-z0-9_]{1,16}=\S{1,40} ){0,12}?"
                      rb"ppid=\d{1,10} pid=(\d{1,10}) auid=\d{1,10} uid=(\d{1,10}) ")

# where a sandbox's events go: called with (kind, detail); a sandbox killed
# meanwhile ignores it (records arrive after the kill)
Sink = Callable[[str, str], None]
# (host uid, pid) of a record -> the sink of the sandbox it names, or None
Resolver = Callable[[int, "int | None"], "Sink | None"]


class AuditUnavailable(Exception):
    """The kernel's audit cannot be read here (no CAP_AUDIT_READ/CONTROL,
    not the initial namespaces, a kernel without audit)."""


def kind_of(blockers: str) -> str:
    """`landlock` for file and network rules, `tampering` for ptrace-class
    access and scoped signals or sockets."""
    return "landlock" if all(b.startswith(("fs.", "net.")) for b in blockers.split(",")) \
        else "tampering"


def _request(sock: socket.socket, kind: int, body: bytes = b"") -> bytes | None:
    """One AUDIT_GET/AUDIT_SET round trip; the AUDIT_GET reply's body, or None."""
    seq = int(time.monotonic_ns() & 0x7FFFFFFF)
    sock.send(NLMSG.pack(NLMSG.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body)
    deadline = time.monotonic() + 2.0
    got: bytes | None = None
    acked = False
    while not acked or (kind == AUDIT_GET and got is None):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuditUnavailable("the kernel's audit did not answer")
        sock.settimeout(left)
        data = sock.recv(65536)
        off = 0
        while off + NLMSG.size <= len(data):
            length, mtype, _, mseq, _ = NLMSG.unpack_from(data, off)
            if length < NLMSG.size:
                break
            payload = data[off + NLMSG.size:off + length]
            if mseq == seq and mtype == NLMSG_ERROR and len(payload) >= 4:
                err = -struct.unpack_from("=i", payload)[0]
                if err:
                    raise OSError(err, os.strerror(err))
                acked = True
            elif mseq == seq and mtype == kind == AUDIT_GET:
                got = payload
            off += (length + 3) & ~3
    return got


def audit_status(sock: socket.socket) -> tuple[int, ...]:
    """struct audit_status: mask, enabled (0 off, 1 on, 2 on and locked),
    failure, pid, rate_limit, backlog_limit, lost, backlog, ..."""
    body = _request(sock, AUDIT_GET)
    if body is None or len(body) < 8:
        raise AuditUnavailable("the kernel's audit status was unreadable")
    return STATUS.unpack_from(body.ljust(STATUS.size, b"\0"))


def audit_enabled(sock: socket.socket) -> int:
    """The kernel's audit `enabled` (0 off, 1 on, 2 on and locked)."""
    enabled: int = audit_status(sock)[1]
    return enabled


def set_audit_enabled(sock: socket.socket, on: bool) -> None:
    _request(sock, AUDIT_SET, STATUS.pack(AUDIT_STATUS_ENABLED, int(on), *[0] * 8))


def set_audit_rate_limit(sock: socket.socket, per_second: int) -> None:
    """The kernel's cap on audit records a second, all together (0: none);
    past it a record is dropped before it is queued."""
    _request(sock, AUDIT_SET, STATUS.pack(AUDIT_STATUS_RATE_LIMIT, 0, 0, 0, per_second,
                                          *[0] * 5))


def _other_readers() -> bool:
    """Another socket of this network namespace is bound to the audit
    multicast group (/proc/net/netlink: protocol 9, group bit 1)."""
    try:
        rows = Path("/proc/net/netlink").read_text().splitlines()[1:]
    except OSError:
        return True  # cannot tell: leave it on
    for row in rows:
        f = row.split()
        if len(f) >= 4 and f[1] == str(NETLINK_AUDIT) and int(f[3], 16) & AUDIT_NLGRP_READLOG:
            return True
    return False


def _control_socket() -> socket.socket:
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
        s.bind((0, 0))
    except OSError as e:
        raise AuditUnavailable(f"no audit netlink socket: {e.strerror}") from None
    return s


def unreadable() -> str | None:
    """Why this process could not read Landlock's audit records (None: it
    can): the multicast group needs CAP_AUDIT_READ, enabling audit
    CAP_AUDIT_CONTROL in the initial namespaces, and Landlock ABI 7."""
    abi = landlock.abi()
    if abi == 0:
        return "no Landlock (not enabled in this kernel)"
    if abi < 7:
        return f"Landlock ABI {abi} logs no denials (7 does)"
    try:
        ctl = _control_socket()
        try:
            audit_enabled(ctl)
        finally:
            ctl.close()
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
        try:
            s.bind((0, AUDIT_NLGRP_READLOG))
        finally:
            s.close()
    except (OSError, AuditUnavailable) as e:
        return f"the kernel's audit cannot be read: {e}"
    return None


@dataclass
class _Pending:
    at: float
    serial: int
    domain: int
    blockers: str
    target: int | None  # the process reached for (ptrace, signal): its sandbox's too


@dataclass
class Stats:
    records: int = 0  # Landlock access records read
    recorded: int = 0  # made events
    unattributed: int = 0  # no sandbox of this node's (another program's domain, or gone)
    lost: int = 0  # dropped by the kernel because the listener's buffer was full
    by_kind: dict[str, int] = field(default_factory=dict)


class RecordReader:
    """What the listener does with each record, apart from its socket:
    domains mapped to sandboxes, access records counted as events."""

    def __init__(self) -> None:
        self._resolvers: list[Resolver] = []
        self._lock = threading.Lock()
        self._domains: collections.OrderedDict[int, Sink | None] = \
            collections.OrderedDict()
        self._pending: list[_Pending] = []
        self.stats = Stats()

    # -- registration --------------------------------------------------------
    def add(self, resolver: Resolver) -> None:
        with self._lock:
            self._resolvers.append(resolver)

    def remove(self, resolver: Resolver) -> int:
        with self._lock:
            if resolver in self._resolvers:
                self._resolvers.remove(resolver)
            return len(self._resolvers)

    def _resolve(self, uid: int, pid: int | None) -> Sink | None:
        with self._lock:
            resolvers = list(self._resolvers)
        for r in resolvers:
            try:
                got = r(uid, pid)
            except Exception:  # a resolver's bug must not end the listener
                log.exception("landlock audit: resolving uid %d", uid)
                continue
            if got is not None:
                return got
        return None

    def message(self, data: bytes) -> None:
        """One datagram of the audit socket: netlink messages, a record each
        (a short or overlong length ends the datagram)."""
        off = 0
        while off + NLMSG.size <= len(data):
            length, mtype, _, _, _ = NLMSG.unpack_from(data, off)
            if length < NLMSG.size or off + length > len(data):
                return
            if mtype in (AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN, AUDIT_SYSCALL):
                self.record(mtype, data[off + NLMSG.size:off + length])
            off += (length + 3) & ~3

    def record(self, mtype: int, text: bytes) -> None:
        """One audit record (its text as the kernel sent it)."""
        m = _HEADER.match(text)
        if m is None:
            return
        serial = int(m.group(3))
        body = text[m.end():]
        if mtype == AUDIT_LANDLOCK_ACCESS:
            a = _ACCESS.match(body)
            if a is None:
                return
            self.stats.records += 1
            domain, blockers = int(a.group(1), 16), a.group(2).decode()
            if domain in self._domains:
                self._count(self._domains[domain], blockers)
            else:
                opid = int(a.group(3)) if a.group(3) else None
                self._pending.append(_Pending(time.monotonic(), serial, domain, blockers,
                                              opid))
                if len(self._pending) > 1024:
                    self._pending.pop(0)
                    self.stats.unattributed += 1
        elif mtype == AUDIT_LANDLOCK_DOMAIN:
            a = _ALLOCATED.match(body)
            if a is not None:
                domain = int(a.group(1), 16)
                target = self._resolve(int(a.group(3)), int(a.group(2)))
                if target is None:  # its creator is gone: the process reached for may tell
                    target = self._by_target(domain)
                if target is not None:  # else the SYSCALL record may tell
                    self._map(domain, target)
                return
            d = _DEALLOCATED.match(body)
            if d is not None:
                self._domains.pop(int(d.group(1), 16), None)
        elif mtype == AUDIT_SYSCALL and self._pending:
            waiting = [p for p in self._pending if p.serial == serial]
            if not waiting:
                return
            s = _SYSCALL.match(body)
            if s is None:
                return
            # the refused process: its uid is its sandbox's, so is its domain
            target = self._resolve(int(s.group(2)), int(s.group(1)))
            for p in waiting:
                if p.domain not in self._domains:
                    self._map(p.domain, target or self._by_target(p.domain))

    def _by_target(self, domain: int) -> Sink | None:
        """The sandbox of the process a refused ptrace or signal reached for
        (uid unknown: its cgroup decides). A sandbox's processes can name
        no other sandbox's (a PID namespace each), so it is the domain's."""
        for p in self._pending:
            if p.domain == domain and p.target:
                got = self._resolve(-1, p.target)
                if got is not None:
                    return got
        return None

    def _map(self, domain: int, target: Sink | None) -> None:
        self._domains[domain] = target
        self._domains.move_to_end(domain)
        while len(self._domains) > MAX_DOMAINS:
            self._domains.popitem(last=False)
        keep = []
        for p in self._pending:
            if p.domain == domain:
                self._count(target, p.blockers)
            else:
                keep.append(p)
        self._pending = keep

    def _count(self, target: Sink | None, blockers: str) -> None:
        if target is None:
            self.stats.unattributed += 1
            return
        kind = kind_of(blockers)
        self.stats.recorded += 1
        self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1
        target(kind, blockers)

    def expire(self, now: float) -> None:
        if self._pending and now - self._pending[0].at > PENDING_AGE:
            old = [p for p in self._pending if now - p.at > PENDING_AGE]
            self.stats.unattributed += len(old)
            self._pending = [p for p in self._pending if now - p.at <= PENDING_AGE]


class AuditListener(RecordReader):
    """The node's reader of Landlock's audit records (one thread for every
    sandbox of every backend registered)."""

    def __init__(self) -> None:
        super().__init__()
        ctl = _control_socket()
        try:
            try:
                self._sock = socket.socket(socket.AF_NETLINK,
                                           socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
                self._sock.bind((0, AUDIT_NLGRP_READLOG))
            except OSError as e:
                raise AuditUnavailable(f"cannot read the kernel's audit records: {e.strerror}"
                                       ) from None
            try:
                status = audit_status(ctl)
                if status[1] == 0:
                    # on, and (if it has none) capped: a sandbox flooding
                    # refusals then costs the kernel's audit thread and this
                    # listener a bounded rate, not a core
                    if status[4] == 0:
                        set_audit_rate_limit(ctl, KERNEL_RATE)
                    set_audit_enabled(ctl, True)
                    try:
                        OWNER_MARK.write_text(json.dumps({"rate_limit": status[4]}))
                    except OSError as e:
                        log.warning("the kernel's audit, turned on, will stay on: %s", e)
            except OSError as e:
                self._sock.close()
                raise AuditUnavailable(f"cannot enable the kernel's audit: {e.strerror}"
                                       ) from None
        finally:
            ctl.close()
        self._sock.setblocking(False)
        self._tokens, self._at = BURST, time.monotonic()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="landlock-audit", daemon=True)
        self._thread.start()

    # -- the thread ----------------------------------------------------------
    def _serve(self) -> None:
        poll = select.poll()
        poll.register(self._sock.fileno(), select.POLLIN)
        poll.register(self._stop_r, select.POLLIN)
        while True:
            wait = self._ration()
            if wait:  # past the ration: let the kernel drop what does not fit
                if self._stopping(wait):
                    return
                continue
            timeout = 1000 if self._pending else -1
            events = poll.poll(timeout)
            if any(fd == self._stop_r for fd, _ in events):
                return
            for _ in range(64):
                try:
                    data = self._sock.recv(1 << 16)
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno == errno.ENOBUFS:  # the kernel dropped records for us
                        self.stats.lost += 1
                        continue
                    log.warning("landlock audit: %s", e)
                    break
                try:
                    self.message(data)
                except Exception:  # never let one record end the listener
                    log.exception("landlock audit: an unreadable record")
                self._tokens -= 1.0
                if self._tokens < 1.0:
                    break
            self.expire(time.monotonic())

    def _ration(self) -> float:
        now = time.monotonic()
        self._tokens = min(BURST, self._tokens + (now - self._at) * RATE)
        self._at = now
        return 0.0 if self._tokens >= 1.0 else (1.0 - self._tokens) / RATE + 0.01

    def _stopping(self, wait: float) -> bool:
        r, _, _ = select.select([self._stop_r], [], [], wait)
        return bool(r)

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(5)
        self._sock.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
        if OWNER_MARK.exists() and not _other_readers():
            try:
                try:
                    before = int(json.loads(OWNER_MARK.read_text())["rate_limit"])
                except (ValueError, KeyError, TypeError):
                    before = 0
                ctl = _control_socket()
                try:
                    set_audit_enabled(ctl, False)
                    set_audit_rate_limit(ctl, before)
                    OWNER_MARK.unlink(missing_ok=True)
                finally:
                    ctl.close()
            except (OSError, AuditUnavailable) as e:
                log.warning("landlock audit: could not turn the kernel's audit back off: %s", e)


# one per process: every backend of the node shares it
_SHARED: AuditListener | None = None
_SHARED_LOCK = threading.Lock()
_UNAVAILABLE_LOGGED = False


def acquire(resolver: Resolver) -> AuditListener | None:
    """Start (or join) the process's listener with `resolver`; None (logged
    once) where audit records cannot be read: Landlock still refuses, the
    denials are not recorded."""
    global _SHARED, _UNAVAILABLE_LOGGED
    with _SHARED_LOCK:
        if _SHARED is None:
            try:
                _SHARED = AuditListener()
            except AuditUnavailable as e:
                if not _UNAVAILABLE_LOGGED:
                    log.warning("Landlock denials will not be recorded: %s", e)
                    _UNAVAILABLE_LOGGED = True
                return None
        _SHARED.add(resolver)
        return _SHARED


def release(resolver: Resolver) -> None:
    """Leave the listener; the last one out stops it (and restores the
    kernel's audit state if the listener changed it)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is not None and _SHARED.remove(resolver) == 0:
            _SHARED.close()
            _SHARED = None
