"""fncall sandboxes through the SDK: a warm pool of real restricted workers
over a lazily loaded image. Each call is a fresh process: a uid of its sandbox's own, its own
PID namespace, no network, a read-only image, a fresh /tmp, Landlock and
seccomp; nothing of one call is visible to the next."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from runtime import ExecTimeout, OutOfMemory, OutputTruncated, Sandbox, Unsupported
from runtime.isolation.hostlimits import fncall_uid
from runtime.node import Node
from tests.helpers.sandboxes import (
    IMAGE,
    SECOND,
    SECOND_MOTD,
    add_second_image,
    busybox_store,
    node_for,
    retag,
    runtime_missing,
)
from tests.helpers.support import gone

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("fncall")
    store = busybox_store(d)
    add_second_image(store, d)
    with node_for(store, d) as n:
        yield n


@pytest.fixture
def fn(node: Node) -> Iterator[Sandbox]:
    with Sandbox.create(IMAGE, backend="fncall", node=node) as s:
        yield s


def test_calls_run_restricted(fn: Sandbox) -> None:
    r = fn.exec("cat /etc/motd; id -u; echo $$")
    # the sandbox's own uid (not root, not shared), PID 1 of its own namespace
    assert r.stdout == f"hello from the image\n{fncall_uid(fn.id)}\n1\n".encode()
    assert fn.exec(["cat"], stdin=b"\x00binary\xff").stdout == b"\x00binary\xff"
    r = fn.exec("echo x > /etc/motd")
    assert r.exit_code != 0 and b"Read-only" in r.stderr
    links = fn.exec("busybox ip -o link").stdout
    assert b"eth" not in links and b"UP" not in links  # no network at all
    assert fn.exec("busybox mount -t tmpfs x /tmp").exit_code != 0
    assert fn.exec("ls /proc").stdout == b""  # no /proc of the host
    r = fn.exec(["no-such-tool"])
    assert r.exit_code == 127 and b"command not found" in r.stderr


def test_each_call_starts_clean(fn: Sandbox) -> None:
    assert fn.exec("echo secret > /tmp/left; ls /tmp").stdout == b"left\n"
    assert fn.exec("ls -A /tmp").stdout == b".lazyfs\n"  # only the launcher, read-only
    assert fn.exec("rm -rf /tmp/.lazyfs; echo x > /tmp/.lazyfs/sandbox-init").exit_code != 0
    tag = str(time.time_ns() % 10**9)
    r = fn.exec(f"busybox sleep 1{tag} >/dev/null 2>&1 & echo started")
    assert r.stdout == b"started\n"
    assert gone(tag)  # the call's PID namespace ended with it


def test_limits(fn: Sandbox) -> None:
    with pytest.raises(ExecTimeout) as e:
        fn.exec("echo before; busybox sleep 30", timeout=0.5)
    assert e.value.result is not None and e.value.result.stdout == b"before\n"
    with pytest.raises(OutputTruncated):
        fn.exec("busybox yes", max_output_bytes=50_000)
    r = fn.exec("busybox dd if=/dev/zero of=/tmp/big bs=1M count=100")
    assert r.exit_code != 0  # the scratch is small
    assert fn.exec("echo still here").stdout == b"still here\n"


def test_an_escaped_process_dies_with_its_call(node: Node) -> None:
    """A call that leaves its session (setsid) and keeps running must not
    outlive its timeout, nor see what a later call of another sandbox puts
    in /tmp."""
    with Sandbox.create(IMAGE, backend="fncall", node=node) as a, \
            Sandbox.create(IMAGE, backend="fncall", node=node) as b:
        spy = ("while :; do cat /tmp/secret >> /tmp/.loot 2>/dev/null; "
               "busybox sleep 0.05; done")
        t0 = time.monotonic()
        with pytest.raises(ExecTimeout):
            a.exec(["busybox", "setsid", "sh", "-c", spy], timeout=1)
        assert time.monotonic() - t0 < 10
        for _ in range(4):  # whichever worker takes it, the spy is gone
            b.exec("echo TOPSECRET > /tmp/secret; busybox sleep 0.2")
        assert a.exec("cat /tmp/.loot /tmp/secret 2>&1").stdout.count(b"TOPSECRET") == 0


def test_limits_of_the_sandbox_hold_per_call(node: Node) -> None:
    with Sandbox.create(IMAGE, backend="fncall", node=node, memory_mb=32) as small:
        with pytest.raises(OutOfMemory):
            small.exec("a=$(busybox yes aaaaaaaa | busybox head -c 200000000)", timeout=60)
        assert small.exec("echo ok").stdout == b"ok\n"
    with Sandbox.create(IMAGE, backend="fncall", node=node, pids=16) as bomb, \
            Sandbox.create(IMAGE, backend="fncall", node=node) as other:
        r = bomb.exec("for i in $(busybox seq 100); do busybox sleep 5 & done; wait",
                      timeout=30)
        assert b"can't fork" in r.stderr
        assert other.exec("echo unaffected").stdout == b"unaffected\n"


def test_a_moved_tag_does_not_switch_a_sandbox(node: Node) -> None:
    """A fncall sandbox runs the digest its name resolved to at create: its
    calls read no catalog (they work with the tag re-pointed, then removed)
    and keep the first image; a new sandbox of the tag gets the new one."""
    first, second = node.images.resolve(IMAGE), node.images.resolve(SECOND)
    store = node.config.store
    retag(store, "moving:fn", IMAGE)
    with Sandbox.create("moving:fn", backend="fncall", node=node) as s:
        assert s.info.image_digest == first
        retag(store, "moving:fn", SECOND)
        assert s.exec("cat /etc/motd").stdout == b"hello from the image\n"
        with Sandbox.create("moving:fn", backend="fncall", node=node) as new:
            assert new.info.image_digest == second
            assert new.exec("cat /etc/motd").stdout == SECOND_MOTD
        retag(store, "moving:fn", None)
        assert s.exec("cat /etc/motd").stdout == b"hello from the image\n"
        assert s.info.image_digest == Sandbox.connect(s.id, node=node).info.image_digest


def test_stateful_calls_are_unsupported(fn: Sandbox) -> None:
    with pytest.raises(Unsupported, match="fncall"):
        fn.files.read("/etc/motd")
    with pytest.raises(Unsupported, match="fncall"):
        fn.pause()
    caps = Sandbox.capabilities("fncall", node=fn._t)
    assert caps["exec"] and not caps["files"] and not caps["pause"]


def test_calls_in_parallel_and_overhead(node: Node) -> None:
    from concurrent.futures import ThreadPoolExecutor
    with Sandbox.create(IMAGE, backend="fncall", node=node) as s:
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: s.exec(f"echo {i}").stdout, range(40)))
        assert outs == [f"{i}\n".encode() for i in range(40)]


def test_a_call_leaving_any_tree_never_fails_another_sandbox(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A call that leaves a directory tree thousands of levels deep (paths
    past PATH_MAX, past Python's recursion limit) in /tmp: on a pool of one
    worker, the very next call (another sandbox's) gets that worker back
    with an empty /tmp, or a fresh one: never an error."""
    d = tmp_path_factory.mktemp("fncall-one")
    # grown from the top (no path ever gets long): 3,000 levels, 6 KB paths
    deep = ("cd /tmp; mkdir d; i=0; while [ $i -lt 3000 ]; do "
            "mkdir t && mv d t/d && mv t d || exit 1; i=$((i+1)); done; echo made")
    with node_for(busybox_store(d), d, fncall_workers=1) as one, \
            Sandbox.create(IMAGE, backend="fncall", node=one) as a, \
            Sandbox.create(IMAGE, backend="fncall", node=one) as b:
        for _ in range(2):
            assert a.exec(deep, timeout=120).stdout == b"made\n"
            assert b.exec("ls -A /tmp; echo ok").stdout == b".lazyfs\nok\n"
            assert a.exec("ls -A /tmp").stdout == b".lazyfs\n"
