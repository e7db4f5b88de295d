"""Denials as events for fncall sandboxes: each call's seccomp filter
notifies, its listener goes to the node before the call's command starts, and
the node answers EPERM and records the call (real workers, real kernel
filters; the denied calls are made by a static program run through the SDK,
as an agent would run it). Each test has its control: a sandbox that was
refused nothing has no events; the flooder really flooded."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Sandbox
from runtime.backends.fncall import FncallBackend
from runtime.isolation import denials
from runtime.node import Node
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, runtime_missing
from tests.helpers.support import wait_until

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]

HOG_SOURCE = Path(__file__).parent / "helpers" / "hog.c"
# the program arrives on stdin: a fncall call's only writable place is its /tmp
RUN_HOG = "cat > /tmp/hog && chmod 755 /tmp/hog && /tmp/hog "
EPERM, ENOSYS = 1, 38
DENIED = ("mount", "unshare", "bpf", "keyctl")


@pytest.fixture(scope="module")
def hog(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (hog.c)")
    out = tmp_path_factory.mktemp("hog") / "hog"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(out), str(HOG_SOURCE)], check=True,
                   capture_output=True)
    return out.read_bytes()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("fncall-denials")
    with node_for(busybox_store(d), d) as n:
        yield n


def _calls(out: bytes) -> dict[str, int]:
    return {name: int(err) for name, err in
            (line.split() for line in out.decode().splitlines() if line != "alive")}


def test_denied_calls_in_fncall_are_events(node: Node, hog: bytes) -> None:
    """mount, unshare, bpf and keyctl fail inside with EPERM, the call goes
    on ("alive") holding no descriptor beyond its stdio (the filter's
    listener never reaches it: with it, the call could answer its own
    denied calls), the sandbox's next call works, and sb.events() names each
    call with its count (the node's metric counts them too); a neighbour
    that was refused nothing has no events."""
    before = node.denial_counts().get("syscall", 0)
    with Sandbox.create(IMAGE, backend="fncall", node=node) as s, \
            Sandbox.create(IMAGE, backend="fncall", node=node) as quiet:
        r = s.exec(RUN_HOG + "calls", stdin=hog, timeout=30)
        assert r.exit_code == 0 and r.stdout.endswith(b"alive\n"), r
        # and the call holds no descriptor but its stdio: not the listener
        assert _calls(r.stdout) == {**dict.fromkeys(DENIED, EPERM), "fds": 0}, r
        r = s.exec("busybox mount -t tmpfs x /tmp; echo rc=$?")
        assert r.stdout == b"rc=1\n" and b"permission denied" in r.stderr, r
        assert s.exec("echo alive").stdout == b"alive\n"
        got = {(e.kind, e.detail): e.count for e in s.events()}
        assert got == {("syscall", "bpf"): 1, ("syscall", "keyctl"): 1,
                       ("syscall", "mount"): 2, ("syscall", "unshare"): 1}, got
        assert quiet.exec("true").exit_code == 0
        assert quiet.events() == []
        assert node.denial_counts().get("syscall", 0) >= before + 5


def test_a_fork_refused_at_the_pids_limit_is_an_event(node: Node) -> None:
    """A call that forks past its sandbox's pids limit: the fork fails
    inside (EAGAIN), the call ends, the refusals are counted as an event of
    that sandbox, and its next call works (control: a call within the limit
    adds none)."""
    with Sandbox.create(IMAGE, backend="fncall", node=node, pids=8) as s:
        assert s.exec("sleep 0.1 & sleep 0.1 & wait; echo ok").stdout == b"ok\n"
        assert s.events() == []
        r = s.exec("for i in $(seq 20); do sleep 1 & done; wait; echo done", timeout=30)
        assert b"Resource temporarily unavailable" in r.stderr, r
        got = {(e.kind, e.detail): e.count for e in s.events()}
        assert got.get(("process_limit", "pids=8"), 0) >= 1, got
        assert s.exec("echo alive").stdout == b"alive\n"


def test_a_denied_call_flood_in_fncall_is_rationed_to_the_flooder(node: Node,
                                                                   hog: bytes) -> None:
    """One call of sandbox A loops on mount(2) in 4 processes for 3 s: it gets
    at most its ration answered (denials.BURST, then denials.RATE a second)
    and waits inside its calls for the rest, while neighbour B's denied call
    is answered at once and recorded, and B's calls take about as long as
    before the flood (a generous bound: the machine is shared). The flooder
    got more than half its burst: it really flooded."""
    with Sandbox.create(IMAGE, backend="fncall", node=node) as a, \
            Sandbox.create(IMAGE, backend="fncall", node=node) as b:

        def timed() -> float:
            t0 = time.monotonic()
            assert b.exec("true").exit_code == 0
            return time.monotonic() - t0

        baseline = statistics.median(timed() for _ in range(7))
        result: list[bytes] = []
        flood = threading.Thread(target=lambda: result.append(
            a.exec(RUN_HOG + "denied 4", stdin=hog, timeout=60).stdout))
        flood.start()
        try:
            wait_until(lambda: any(e.count >= denials.BURST / 2 for e in a.events()), 30,
                       "the flood to use its burst")
            during = statistics.median(timed() for _ in range(7))
            r = b.exec("busybox mount -t tmpfs x /tmp; echo rc=$?", timeout=10)
            assert r.stdout == b"rc=1\n", r  # answered (EPERM), not queued behind a's flood
        finally:
            flood.join(60)
        assert {(e.kind, e.detail) for e in b.events()} == {("syscall", "mount")}
        total = int(result[0].split()[-1])
        assert denials.BURST / 2 < total <= denials.BURST + denials.RATE * (3 + 2), result
        assert during < 5 * baseline + 0.5, (baseline, during)
        assert a.exec("echo alive").stdout == b"alive\n"


def test_denied_calls_stay_refused_without_the_listener(tmp_path: Path, hog: bytes) -> None:
    """The node's listener closed (what a node that died leaves: nobody holds
    the calls' listeners): every denied call still fails, now with ENOSYS
    from the kernel, and the sandbox keeps working; nothing is recorded."""
    with node_for(busybox_store(tmp_path), tmp_path) as node, \
            Sandbox.create(IMAGE, backend="fncall", node=node) as s:
        backend = node.backend("fncall")
        assert isinstance(backend, FncallBackend)
        backend.denials.listener().close()
        r = s.exec(RUN_HOG + "calls", stdin=hog, timeout=30)
        assert r.exit_code == 0 and r.stdout.endswith(b"alive\n"), r
        assert _calls(r.stdout) == {**dict.fromkeys(DENIED, ENOSYS), "fds": 0}, r
        assert s.exec("echo alive").stdout == b"alive\n"
        assert s.events() == []


def test_landlock_refusals_in_fncall_are_events(node: Node) -> None:
    """A call connecting and listening over TCP gets EACCES from its
    Landlock rules, and each refusal becomes a `landlock` event of its
    sandbox (Landlock's audit records, read by the node) named as the
    kernel names it; a neighbour whose calls stayed inside their rules has
    none. A write outside /tmp fails with EROFS (the read-only root refuses
    it before Landlock looks: not a Landlock event). Without the node's
    audit listener, or without LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON in
    sandbox-init (the records would stop at the call's exec), the call is
    refused the same and no event appears."""
    with Sandbox.create(IMAGE, backend="fncall", node=node) as s, \
            Sandbox.create(IMAGE, backend="fncall", node=node) as quiet:
        backend = node.backend("fncall")
        assert isinstance(backend, FncallBackend)
        if backend.denials.audit is None:
            pytest.skip("the kernel's audit records cannot be read here (see the node's log)")
        r = s.exec("busybox nc 127.0.0.1 80; echo c=$?; busybox nc -l -p 8080; echo l=$?; "
                   "echo x > /etc/x; echo w=$?; echo x > /tmp/ok; echo t=$?")
        assert r.stdout == b"c=1\nl=1\nw=1\nt=0\n", r
        assert r.stderr.count(b"Permission denied") == 2, r  # EACCES: Landlock
        assert b"Read-only file system" in r.stderr, r
        assert quiet.exec("echo x > /tmp/ok; cat /tmp/ok").stdout == b"x\n"

        def landlock() -> dict[str, int] | None:
            got = {e.detail: e.count for e in s.events() if e.kind == "landlock"}
            return got if {"net.bind_tcp", "net.connect_tcp"} <= got.keys() else None
        got = wait_until(landlock, 5, "landlock events")
        assert got == {"net.bind_tcp": 1, "net.connect_tcp": 1}, got
        assert quiet.events() == []
