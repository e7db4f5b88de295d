"""Resources per sandbox, never per host: what one hostile container sandbox
can take from the host's disk and kernel tables, and that a neighbour still
gets its share (real runc, real kernel; the attacks run as commands through
the SDK, as an agent would run them).

Each limit has a control: the same action within the limit succeeds, so a
passing test means the limit held, not that the action was broken."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lazyfs import sysmount
from runtime import NetworkPolicy, Sandbox
from runtime.backends.container import START_LOG
from runtime.isolation import denials
from runtime.node import Node
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, runtime_missing
from tests.helpers.support import wait_until

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]

NODE_DISK_MB = 32  # the test node's default writable layer
_libc = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("limits")
    with node_for(busybox_store(d), d, disk_mb=NODE_DISK_MB) as n:
        yield n


def _host_bytes(d: Path) -> int:
    """Bytes the files under `d` hold on the host's own filesystem (what
    `du -x` counts: other filesystems mounted below are not followed)."""
    dev = d.stat().st_dev
    total = 0
    for root, dirs, files in os.walk(d):
        dirs[:] = [x for x in dirs if (Path(root) / x).lstat().st_dev == dev]
        for f in files:
            try:
                st = (Path(root) / f).lstat()
            except OSError:
                continue
            if st.st_dev == dev:
                total += st.st_blocks * 512
    return total


def _mb_written(sb: Sandbox, path: str, mb: int) -> tuple[int, bytes]:
    r = sb.exec(f"dd if=/dev/zero of={path} bs=1M count={mb} 2>&1; echo rc=$?; "
                f"wc -c < {path}")
    return int(r.stdout.split()[-1]) >> 20, r.stdout


# -- disk -------------------------------------------------------------------------


def test_a_default_sandbox_sees_and_hits_its_disk_limit(node: Node) -> None:
    """A sandbox created without disk_mb: statvfs of / shows the node's
    default, a write past it fails with ENOSPC inside, the host's disk under
    the node's state directory does not grow, and a neighbour writes as
    before."""
    state = node.config.state_dir
    before = _host_bytes(state)
    with Sandbox.create(IMAGE, node=node) as a, Sandbox.create(IMAGE, node=node) as b:
        df = a.exec("stat -f -c '%b %S' /").stdout.split()
        assert int(df[0]) * int(df[1]) == NODE_DISK_MB << 20  # the limit, not the host's
        got, out = _mb_written(a, "/fill", 4 * NODE_DISK_MB)
        assert b"No space left on device" in out and b"rc=0" not in out, out
        assert got < NODE_DISK_MB
        assert _host_bytes(state) - before < 4 << 20  # the bytes are not on the host's disk
        # the neighbour: its own layer, untouched by A's
        got_b, out_b = _mb_written(b, "/mine", NODE_DISK_MB // 2)
        assert got_b == NODE_DISK_MB // 2 and b"rc=0" in out_b, out_b
        # the hit is an event of A's (the command that filled it), none of B's
        full = [e for e in a.events() if e.kind == "disk_limit"]
        assert [(e.detail, e.count) for e in full] == [(f"disk_mb={NODE_DISK_MB} full", 1)]
        assert not [e for e in b.events() if e.kind == "disk_limit"]
        # A, having freed its space, writes again (and records no new hit)
        a.exec("rm /fill")
        assert a.exec("echo ok > /small && cat /small").stdout == b"ok\n"
        assert [e.count for e in a.events() if e.kind == "disk_limit"] == [1]
        # no sandbox adds a mount to the host's table (its upper left it too)
        assert not [m for m in sysmount.mounts() if str(node.config.sandboxes) in m.mount_point]


def test_control_a_larger_disk_takes_the_same_write(node: Node) -> None:
    """Control: the same write fits a sandbox asking for a larger disk, so
    what stopped it above was the default limit."""
    with Sandbox.create(IMAGE, node=node, disk_mb=6 * NODE_DISK_MB,
                        memory_mb=512) as s:
        got, out = _mb_written(s, "/fill", 4 * NODE_DISK_MB)
        assert got == 4 * NODE_DISK_MB and b"rc=0" in out, out


def test_init_stdio_cannot_grow_the_start_log(node: Node) -> None:
    """runc hands init its log as stderr; init drops it before any command
    runs, so writing through init's (or any process's) descriptors cannot
    grow STATE/sandboxes/<id>/start.log (the starter's stderr)."""
    with Sandbox.create(IMAGE, node=node) as s:
        log = node.config.sandboxes / s.id / START_LOG
        size = log.stat().st_size
        r = s.exec("for f in /proc/[0-9]*/fd/[12]; do case $f in /proc/$$/*) continue;; esac; "
                   "head -c 4194304 /dev/zero >> $f 2>/dev/null; done; echo done")
        assert r.stdout.endswith(b"done\n")
        assert log.stat().st_size == size


# -- host-wide kernel tables --------------------------------------------------------
# A hostile program (tests/helpers/hog.c) takes open files, inotify instances or
# watches in several processes until the kernel refuses; sandbox B, started
# next to it, still gets its own share.

HOG_SOURCE = Path(__file__).parent / "helpers" / "hog.c"
HOG = "/tmp/hog"
BUDGETS = {"inotify": 24, "watches": 600}  # the test node's per-sandbox inotify budgets


@pytest.fixture(scope="module")
def hog(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (hog.c)")
    out = tmp_path_factory.mktemp("hog") / "hog"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(out), str(HOG_SOURCE)], check=True,
                   capture_output=True)
    return out.read_bytes()


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node whose per-sandbox inotify budgets are small (BUDGETS)."""
    d = tmp_path_factory.mktemp("tight")
    with node_for(busybox_store(d), d, inotify_instances=BUDGETS["inotify"],
                  inotify_watches=BUDGETS["watches"]) as n:
        yield n


def _take(sb: Sandbox, hog: bytes, what: str, procs: int) -> list[tuple[int, int]]:
    """Run the hog in the background (it keeps what it took); each process's
    (count, errno)."""
    sb.files.write(HOG, hog, mode=0o755)
    sb.exec(f"setsid {HOG} {what} {procs} </dev/null >/tmp/hog.out 2>&1 &")
    wait_until(lambda: b"total" in sb.exec("cat /tmp/hog.out").stdout, 30, f"the {what} hog")
    lines = sb.exec("cat /tmp/hog.out").stdout.decode().splitlines()
    return [(int(a), int(b)) for a, b in (ln.split() for ln in lines if ln[0].isdigit())]


@pytest.mark.parametrize("what", ["inotify", "watches"])
def test_one_sandbox_cannot_take_anothers_inotify(tight: Node, hog: bytes, what: str) -> None:
    """Attack 5 of the issue: inotify instances and watches are budgets per
    user, and every container's root was the host's root. Now sandbox A,
    taking all it can in 4 processes, ends at its own budget (the control:
    it does get all of it), and sandbox B then gets its whole budget too, as
    does the host."""
    budget = BUDGETS[what]
    with Sandbox.create(IMAGE, node=tight) as a, Sandbox.create(IMAGE, node=tight) as b:
        # its budget is not its own to raise
        name = {"inotify": "instances", "watches": "watches"}[what]
        r = a.exec(f"echo 1000000 > /proc/sys/user/max_inotify_{name}; "
                   f"cat /proc/sys/user/max_inotify_{name}")
        assert r.stdout == f"{budget}\n".encode(), r
        took = _take(a, hog, what, 4)
        assert sum(n for n, _ in took) == budget, took
        refused = {errno.EMFILE if what == "inotify" else errno.ENOSPC}
        assert {e for _, e in took} <= refused, took
        took_b = _take(b, hog, what, 1)
        assert took_b[0][0] == budget, took_b
        fd = _libc.inotify_init1(os.O_CLOEXEC)  # the host's own root
        assert fd >= 0
        os.close(fd)


def test_open_files_are_a_per_process_budget(node: Node, hog: bytes) -> None:
    """A sandbox's processes each stop at its open_files (EMFILE), not at the
    host's file table (ENFILE); a neighbour and the host open files as before.
    Control: a sandbox with a larger open_files gets that many."""
    with Sandbox.create(IMAGE, node=node, open_files=256, pids=64) as a, \
            Sandbox.create(IMAGE, node=node, open_files=512) as b:
        took = _take(a, hog, "files", 16)
        assert len(took) == 16
        assert {e for _, e in took} == {errno.EMFILE}, took
        assert {n for n, _ in took} == {256 - 4}  # stdio and the report pipe are open
        took_b = _take(b, hog, "files", 1)
        assert took_b == [(512 - 4, errno.EMFILE)]
        with open("/dev/null") as f:
            assert f.fileno() >= 0


def test_fncall_sandboxes_have_per_user_budgets_of_their_own(node: Node) -> None:
    """The kernel counts inotify instances and watches (and processes) per
    user: every call of one fncall sandbox runs as the same uid, which no
    other sandbox's calls (and no user of the host) share, so a call taking
    its whole budget leaves every other sandbox's intact."""
    with Sandbox.create(IMAGE, backend="fncall", node=node) as a, \
            Sandbox.create(IMAGE, backend="fncall", node=node) as b:
        uids = [int(s.exec("id -u").stdout) for s in (a, a, b)]
        assert uids[0] == uids[1] != uids[2]
        host_users = {int(ln.split(":")[2]) for ln in Path("/etc/passwd").read_text().splitlines()
                      if ln.count(":") >= 6}
        assert not host_users & set(uids)


# -- denials as events --------------------------------------------------------------


def test_a_denied_system_call_is_an_event(node: Node) -> None:
    """A denied mount(2) and unshare(2) fail inside as before (EPERM, the
    sandbox lives on) and are recorded: sb.events() counts them by system
    call. Control: a sandbox that was refused nothing has no events."""
    with Sandbox.create(IMAGE, node=node) as s, Sandbox.create(IMAGE, node=node) as quiet:
        r = s.exec("mount -t tmpfs x /mnt; echo rc=$?; mount -t tmpfs x /mnt; unshare -n true; "
                   "echo rc=$?")
        assert r.stdout == b"rc=1\nrc=1\n" and b"not permitted" in r.stderr, r
        assert s.exec("echo alive").stdout == b"alive\n"
        got = {(e.kind, e.detail): e.count for e in s.events()}
        assert got[("syscall", "mount")] == 2
        assert got[("syscall", "unshare")] == 1
        assert quiet.events() == []
        assert quiet.exec("true").exit_code == 0


def test_a_denied_call_flood_is_rationed_to_the_flooder(node: Node, hog: bytes) -> None:
    """Each denied call is answered by the node, on the node's CPU: a
    sandbox looping on one (4 processes calling mount(2) for 3 s) gets at
    most its ration answered (denials.BURST, then denials.RATE a second) and
    waits inside its calls for the rest, while a neighbour's denied call is
    answered at once and recorded. Without the ration the same loop got
    ~35,000 answers a second (the control: it still gets more than half its
    burst, so it really flooded)."""
    with Sandbox.create(IMAGE, node=node) as a, Sandbox.create(IMAGE, node=node) as b:
        a.files.write(HOG, hog, mode=0o755)
        a.exec(f"setsid {HOG} denied 4 </dev/null >/tmp/hog.out 2>&1 &")
        wait_until(lambda: any(e.count >= denials.BURST for e in a.events()), 30,
                   "the flood to use its burst")
        r = b.exec("mount -t tmpfs x /mnt; echo rc=$?", timeout=10)
        assert r.stdout == b"rc=1\n", r  # answered (EPERM), not queued behind a's flood
        assert {(e.kind, e.detail) for e in b.events()} == {("syscall", "mount")}
        wait_until(lambda: b"total" in a.exec("cat /tmp/hog.out").stdout, 30, "the flood")
        total = int(a.exec("cat /tmp/hog.out").stdout.split()[-1])
        assert denials.BURST / 2 < total <= denials.BURST + denials.RATE * (3 + 2), total
        assert a.exec("echo alive").stdout == b"alive\n"


def test_a_refused_connection_is_an_event(node: Node) -> None:
    """With a network allowlist, each refused destination is counted inside
    the sandbox's own network namespace and shows in sb.events(); the
    allowed destination connects and is not an event (the control)."""
    server = socket.create_server(("0.0.0.0", 0))
    allowed = server.getsockname()[1]

    def hang_up() -> None:  # accept and close at once: the sandbox's nc ends
        with contextlib.suppress(OSError):
            while True:
                server.accept()[0].close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        with Sandbox.create(IMAGE, node=node,
                            network=NetworkPolicy.allow_only(f"node:{allowed}")) as s:
            host = s.info.host_address
            r = s.exec(f"busybox nc -w 2 {host} {allowed} </dev/null; echo ok=$?; "
                       f"busybox nc -w 2 {host} 9 </dev/null; busybox nc -w 2 {host} 9 </dev/null; "
                       "busybox nc -w 2 192.0.2.1 80 </dev/null; echo refused=$?")
            assert b"ok=0" in r.stdout and b"refused=1" in r.stdout, r
            got = {(e.kind, e.detail): e.count for e in s.events()}
            assert got.get(("connect", f"{host}:9/tcp"), 0) >= 2, got
            assert got.get(("connect", "192.0.2.1:80/tcp"), 0) >= 1, got
            assert not [d for k, d in got if k == "connect" and d.endswith(f":{allowed}/tcp")]
    finally:
        server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        server.close()


def test_the_allowlist_holds_where_landlock_could_not_and_cannot_be_rewritten(
        node: Node) -> None:
    """Why containers get no Landlock network rules (docs/security.md): the
    nftables allowlist in the sandbox's own netns already refuses what
    Landlock's TCP-only rules (ABI 7) would, plus what they cannot name, and
    the sandbox cannot change it. From inside: UDP to a refused destination
    (a DNS query) is rejected and counted, ICMP (ping) gets no answer, and rewriting
    the namespace's addresses, links or routes (which the rules are written
    against) is refused (no CAP_NET_ADMIN, CAP_NET_RAW). Control: the allowed
    TCP port connects."""
    server = socket.create_server(("0.0.0.0", 0))
    allowed = server.getsockname()[1]

    def hang_up() -> None:
        with contextlib.suppress(OSError):
            while True:
                server.accept()[0].close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        with Sandbox.create(IMAGE, node=node,
                            network=NetworkPolicy.allow_only(f"node:{allowed}")) as s:
            host = s.info.host_address
            r = s.exec(f"busybox nc -w 2 {host} {allowed} </dev/null; echo tcp=$?; "
                       f"busybox timeout 5 busybox nslookup example.org {host}; echo udp=$?; "
                       f"busybox timeout 3 busybox ping -c 1 -W 1 {host}; echo ping=$?; "
                       "busybox ip addr add 10.255.0.9/32 dev eth0; echo addr=$?; "
                       "busybox ip link set eth0 down; echo link=$?; "
                       "busybox ip route del default; echo route=$?", timeout=60)
            out = r.stdout.decode()
            assert "tcp=0" in out, r  # the control
            assert "udp=0" not in out and "ping=0" not in out and "addr=0" not in out, r
            assert "link=0" not in out and "route=0" not in out, r
            assert r.stderr.count(b"Operation not permitted") >= 3, r
            got = {(e.kind, e.detail): e.count for e in s.events()}
            assert got.get(("connect", f"{host}:53/udp"), 0) >= 1, (got, r.stderr.decode())
            again = s.exec(f"busybox nc -w 2 {host} {allowed} </dev/null; echo tcp=$?")
            assert b"tcp=" in again.stdout  # the rules and the route are as they were
            assert s.exec("busybox ip route").stdout.startswith(b"default via"), r
    finally:
        server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        server.close()


def test_the_network_policy_follows_the_task_phase(node: Node) -> None:
    """set_network: a sandbox made without network gets one for its setup
    phase, loses it for the agent's (new connects refused, and a connection
    the setup left open is cut: its later data never arrives), and gets it
    back (a verify phase). The kept connection's first line is the control
    that it really worked before the change."""
    server = socket.create_server(("0.0.0.0", 0))
    port = server.getsockname()[1]

    def echo(c: socket.socket) -> None:
        with c, contextlib.suppress(OSError):
            while data := c.recv(4096):
                c.sendall(data)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with Sandbox.create(IMAGE, node=node) as s:
            assert s.info.host_address is None
            host = s.set_network(NetworkPolicy.allow_only(f"node:{port}")).host_address
            assert host and s.info.spec.network.mode == "allowlist"
            assert s.exec(f"echo hi | busybox nc -w 2 {host} {port}").stdout == b"hi\n"
            s.exec(f"setsid sh -c '(echo first; sleep 3; echo second) | busybox nc -w 6 {host} "
                   f"{port} >/tmp/got 2>/dev/null; echo $? >/tmp/done' </dev/null >/dev/null "
                   "2>&1 &")
            wait_until(lambda: s.exec("cat /tmp/got").stdout == b"first\n", 10,
                       "the kept connection's first line")
            s.set_network(NetworkPolicy.none())
            r = s.exec(f"echo hi | busybox nc -w 2 {host} {port}; echo rc=$?")
            assert r.stdout == b"rc=1\n", r
            wait_until(lambda: s.exec("cat /tmp/done").exit_code == 0, 20,
                       "the kept connection's nc to end")
            assert s.exec("cat /tmp/got").stdout == b"first\n"  # "second" was cut
            got = {(e.kind, e.detail): e.count for e in s.events()}
            assert got.get(("connect", f"{host}:{port}/tcp"), 0) >= 1, got
            s.set_network(NetworkPolicy.allow_only(f"node:{port}"))
            assert s.exec(f"echo again | busybox nc -w 2 {host} {port}").stdout == b"again\n"
            assert Sandbox.connect(s.id, node=node).info.spec.network.mode == "allowlist"
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
