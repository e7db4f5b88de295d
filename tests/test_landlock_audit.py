"""The node's reader of Landlock's audit records, fed what a hostile sandbox
could make the kernel write (runtime/isolation/landlock_audit.py RecordReader with a
real DenialLog). The records' shapes are the kernel's (6.18, captured from
real denials); the sandbox chooses only paths, comm and exe, which the
kernel escapes, and how many records there are. The end-to-end tests (real
runc and fncall sandboxes, real kernel records) are in test_exec_integrity
and test_sandbox_fncall_denials."""

from __future__ import annotations

import random
import struct

from runtime.isolation import denials, landlock_audit
from runtime.isolation.denials import DenialLog
from runtime.isolation.landlock_audit import (
    AUDIT_LANDLOCK_ACCESS,
    AUDIT_LANDLOCK_DOMAIN,
    AUDIT_SYSCALL,
    NLMSG,
    RecordReader,
    kind_of,
)

SANDBOX, NEIGHBOUR = "sb-00000000000000a1", "sb-00000000000000b2"
BASE = 1 << 31  # the first host id of the sandbox's range


def reader() -> tuple[RecordReader, DenialLog]:
    log = DenialLog()
    r = RecordReader()

    def whose(uid: int, pid: int | None) -> landlock_audit.Sink | None:
        if BASE <= uid < BASE + 65536:
            return lambda kind, detail: log.record(SANDBOX, kind, detail)  # type: ignore[arg-type]
        if BASE + 65536 <= uid < BASE + 2 * 65536:
            return lambda kind, detail: log.record(NEIGHBOUR, kind,  # type: ignore[arg-type]
                                                   detail)
        return None
    r.add(whose)
    return r, log


def access(serial: int, domain: str, rest: str) -> bytes:
    return f"audit(1796390763.751:{serial}): domain={domain} {rest}".encode()


def allocated(serial: int, domain: str, uid: int, comm: str = '"sh"') -> bytes:
    return (f"audit(1796390763.751:{serial}): domain={domain} status=allocated "
            f"mode=enforcing pid=4242 uid={uid} exe=\"/usr/bin/dash\" comm={comm}").encode()


def events(log: DenialLog, sandbox: str) -> dict[tuple[str, str], int]:
    return {(e.kind, e.detail): e.count for e in log.events(sandbox)}


def test_a_denial_is_counted_on_the_domains_sandbox() -> None:
    r, log = reader()
    r.record(AUDIT_LANDLOCK_ACCESS, access(2, "1cd06c50e", 'blockers=ptrace opid=77 ocomm="sh"'))
    assert events(log, SANDBOX) == {}  # waits for the domain's record
    r.record(AUDIT_LANDLOCK_DOMAIN, allocated(2, "1cd06c50e", BASE))
    r.record(AUDIT_LANDLOCK_ACCESS, access(3, "1cd06c50e", 'blockers=scope.signal opid=1 '
                                                         'ocomm="sandbox-init"'))
    r.record(AUDIT_LANDLOCK_ACCESS, access(4, "1cd06c50e", 'blockers=ptrace opid=78 ocomm="x"'))
    assert events(log, SANDBOX) == {("tampering", "ptrace"): 2, ("tampering", "scope.signal"): 1}
    assert events(log, NEIGHBOUR) == {}
    # freed: a record naming it again (none should) waits for a domain record
    r.record(AUDIT_LANDLOCK_DOMAIN, b"audit(1.2:5): domain=1cd06c50e status=deallocated "
                                    b"denials=3")
    r.record(AUDIT_LANDLOCK_ACCESS, access(6, "1cd06c50e", "blockers=ptrace opid=1"))
    assert events(log, SANDBOX)[("tampering", "ptrace")] == 2


def test_the_refused_process_names_the_sandbox_when_the_domain_record_is_missing() -> None:
    """The kernel dropped the DOMAIN record (backlog full): the SYSCALL
    record of the same event names the refused process's uid."""
    r, log = reader()
    r.record(AUDIT_LANDLOCK_ACCESS, access(9, "ab", "blockers=net.connect_tcp daddr=127.0.0.1 "
                                                    "dest=80"))
    r.record(AUDIT_SYSCALL, (
        f"audit(1796390763.755:9): arch=c000003e syscall=42 success=no exit=-13 a0=3 a1=7ff "
        f"a2=10 a3=0 items=0 ppid=16677 pid=16681 auid=4294967295 uid={BASE + 65536 + 1000} "
        f"gid=0 euid=0 comm=\"nc\" exe=\"/bin/busybox\" key=(null)").encode())
    assert events(log, NEIGHBOUR) == {("landlock", "net.connect_tcp"): 1}
    # the domain's creator names no sandbox (it is gone, say): the refused
    # process of the same event still does
    r.record(AUDIT_LANDLOCK_ACCESS, access(11, "ef", "blockers=ptrace opid=1"))
    r.record(AUDIT_LANDLOCK_DOMAIN, allocated(11, "ef", 0))
    r.record(AUDIT_SYSCALL, (
        f"audit(1796390763.755:11): arch=c000003e syscall=101 success=no exit=-1 a0=10 "
        f"items=0 ppid=1 pid=2 auid=4294967295 uid={BASE + 7} gid=0").encode())
    assert events(log, SANDBOX) == {("tampering", "ptrace"): 1}
    # neither names one: the process reached for does (the resolver sees
    # uid -1 and its pid; here pid 77 stands for a process of NEIGHBOUR's)
    log2, r2 = DenialLog(), RecordReader()

    def by_target(uid: int, pid: int | None) -> landlock_audit.Sink | None:
        if (uid, pid) != (-1, 77):
            return None
        return lambda kind, detail: log2.record(NEIGHBOUR, kind, detail)  # type: ignore[arg-type]
    r2.add(by_target)
    r2.record(AUDIT_LANDLOCK_ACCESS, access(12, "12", 'blockers=scope.signal opid=77 ocomm="a"'))
    r2.record(AUDIT_LANDLOCK_DOMAIN, allocated(12, "12", 0))
    assert events(log2, NEIGHBOUR) == {("tampering", "scope.signal"): 1}
    # a record that never finds its sandbox is dropped after PENDING_AGE
    r.record(AUDIT_LANDLOCK_ACCESS, access(10, "cd", "blockers=ptrace opid=1"))
    r.expire(1e12)
    assert r.stats.unattributed == 1 and events(log, SANDBOX) == {("tampering", "ptrace"): 1}


def test_sandbox_strings_never_become_details() -> None:
    """Only the kernel's prefix is read: a path or comm (escaped by the
    kernel, but say it were not) that spells more fields changes nothing."""
    r, log = reader()
    r.record(AUDIT_LANDLOCK_DOMAIN, allocated(1, "aa", BASE, comm='"x blockers=ptrace"'))
    r.record(AUDIT_LANDLOCK_ACCESS, access(2, "aa", 'blockers=fs.write_file path="/tmp/a '
                                                    'blockers=ptrace domain=bb" dev="tmpfs"'))
    r.record(AUDIT_LANDLOCK_ACCESS, access(3, "aa", 'blockers=fs.write_file,fs.truncate '
                                                    'path=2F746D70'))
    assert events(log, SANDBOX) == {("landlock", "fs.write_file"): 1,
                                    ("landlock", "fs.write_file,fs.truncate"): 1}
    # malformed: not read, not counted, no exception
    for body in ["blockers=PTRACE", "blockers=", "blockers=a" * 3, "blockers=" + "x" * 40,
                 "blockers=" + ",".join(["fs.a"] * 40), 'blockers="ptrace"', "blockers=ptrace\n"]:
        r.record(AUDIT_LANDLOCK_ACCESS, access(4, "aa", body))
    r.record(AUDIT_LANDLOCK_ACCESS, b"audit(x): domain=aa blockers=ptrace")
    r.record(AUDIT_LANDLOCK_ACCESS, b"domain=aa blockers=ptrace")
    r.record(AUDIT_LANDLOCK_ACCESS, access(5, "z" * 17, "blockers=ptrace"))
    assert sum(events(log, SANDBOX).values()) == 2


def test_details_stay_capped_however_many_kinds_of_denial() -> None:
    r, log = reader()
    r.record(AUDIT_LANDLOCK_DOMAIN, allocated(1, "aa", BASE))
    names = [f"fs.{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(200)]
    for i, n in enumerate(names):
        r.record(AUDIT_LANDLOCK_ACCESS, access(2 + i, "aa", f"blockers={n}"))
    got = events(log, SANDBOX)
    assert len(got) == denials.MAX_DETAILS + 1 and ("landlock", denials.OTHER) in got
    assert sum(got.values()) == 200


def test_garbage_datagrams_never_raise() -> None:
    """Whatever arrives on the socket: short headers, lengths past the end
    or below a header, random bytes in records of the types read."""
    r, _ = reader()
    rng = random.Random(7)
    for _ in range(3000):
        mtype = rng.choice([AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN, AUDIT_SYSCALL, 1320])
        body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))
        if rng.random() < 0.5:
            body = b"audit(1.2:3): domain=aa " + body
        length = rng.choice([NLMSG.size + len(body), 0, 3, 1 << 20, NLMSG.size - 1])
        r.message(NLMSG.pack(length, mtype, 0, 0, 0) + body + b"\x00" * rng.randrange(4))
        r.message(body[:rng.randrange(0, 20)])
    r.expire(1e12)
    assert r.stats.recorded == 0


def test_kinds() -> None:
    assert kind_of("ptrace") == kind_of("scope.signal") == "tampering"
    assert kind_of("scope.abstract_unix_socket") == "tampering"
    assert kind_of("fs.write_file,fs.truncate") == kind_of("net.bind_tcp") == "landlock"


def test_an_audit_status_request_is_well_formed() -> None:
    """AUDIT_SET carries struct audit_status with the mask first."""
    body = landlock_audit.STATUS.pack(landlock_audit.AUDIT_STATUS_ENABLED, 1, *[0] * 8)
    assert struct.unpack_from("=II", body) == (1, 1) and len(body) == 40
