"""Container sandboxes end to end through the SDK: real runc, real cgroups,
a lazily loaded root from a real lazyfs daemon, real overlayfs.

Each test checks what an RL framework would: the command's output and exit
code, typed errors for limits, that the sandbox cannot see or change the host
or other sandboxes, and that nothing (mount, cgroup, process) outlives it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import trio

from lazyfs import sysmount
from lazyfs.node import request
from runtime import (
    AsyncSandbox,
    BackendUnavailable,
    ExecTimeout,
    FileError,
    ImageNotFound,
    InvalidSpec,
    NetworkPolicy,
    OutOfMemory,
    OutputTruncated,
    QuotaExceeded,
    Sandbox,
    SandboxNotFound,
    SandboxStateError,
)
from runtime.backends.container import ContainerBackend
from runtime.config import RuntimeConfig
from runtime.isolation import cgroups
from runtime.node import Node
from tests.helpers.sandboxes import (
    IMAGE,
    SECOND,
    SECOND_MOTD,
    add_second_image,
    busybox_node,
    busybox_store,
    node_for,
    retag,
    runtime_missing,
)
from tests.helpers.support import Hello, gone, processes_with, tcp_listening, wait_until

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("rt")
    store = busybox_store(d)
    add_second_image(store, d)
    with node_for(store, d) as n:
        yield n


@pytest.fixture
def sb(node: Node) -> Iterator[Sandbox]:
    with Sandbox.create(IMAGE, node=node, memory_mb=256, labels={"test": "container"}) as s:
        yield s


def test_exec_output_exit_code_stdin_env_cwd(sb: Sandbox) -> None:
    r = sb.exec("cat /etc/motd; echo oops >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"hello from the image\n", b"oops\n")
    assert r.duration > 0 and not r.truncated
    assert sb.exec(["cat"], stdin=b"\x00\xffbinary").stdout == b"\x00\xffbinary"
    assert sb.exec("echo $GREETING; pwd", env={"GREETING": "hi"}, cwd="/etc").stdout == \
        b"hi\n/etc\n"
    chunks: list[bytes] = []
    r = sb.exec("for i in 1 2 3; do echo $i; sleep 0.1; done", on_stdout=chunks.append)
    assert b"".join(chunks) == r.stdout == b"1\n2\n3\n" and len(chunks) >= 2
    r = sb.exec(["no-such-command", "x"])
    assert r.exit_code == 127 and b"no-such-command: command not found" in r.stderr


def test_files_round_trip_and_stay_inside(sb: Sandbox, tmp_path: Path) -> None:
    sb.files.write("/work/a/b.txt", b"patch")
    assert sb.exec("cat /work/a/b.txt").stdout == b"patch"
    assert [e.name for e in sb.files.list("/work/a")] == ["b.txt"]
    sb.exec("ln -s /etc/shadow /work/link; echo made-here > /work/made")
    assert sb.files.read("/work/made") == b"made-here\n"
    with pytest.raises(FileError):
        sb.files.read("/work/link")  # the sandbox's /etc/shadow (none), never the host's
    local = tmp_path / "up.bin"
    local.write_bytes(os.urandom(100_000))
    sb.files.upload(local, "/work/up.bin")
    sb.files.download("/work/up.bin", tmp_path / "down.bin")
    assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()
    sb.files.remove("/work", recursive=True)
    assert sb.exec("ls /work").exit_code != 0
    with pytest.raises(FileError, match="No such file"):
        sb.files.read("/nope")


def test_sandbox_sees_nothing_of_the_host(sb: Sandbox) -> None:
    assert sb.exec("ls /").stdout.split() == sorted(
        b"bin data dev etc proc root sbin sys tmp usr var".split())
    assert sb.exec("busybox hostname").stdout.strip() == sb.id.encode()
    assert sb.exec("cat /proc/1/cmdline | tr '\\0' ' '").stdout.startswith(
        b"/dev/.sandbox-init init")
    links = sb.exec("busybox ip -o link").stdout
    assert b"lo:" in links and b"eth" not in links  # no network by default
    assert sb.info.host_address is None  # and so no node side to reach
    assert sb.exec("busybox mount -t tmpfs x /tmp").exit_code != 0
    assert sb.exec("cat /proc/kcore | wc -c").stdout.strip() == b"0"  # masked
    assert b"Read-only" in sb.exec("echo 1 > /proc/sys/kernel/domainname").stderr
    assert sb.exec("echo x > /sys/kernel/uevent_helper").exit_code != 0


def test_a_node_holding_thousands_of_descriptors_still_works(node: Node) -> None:
    """A full node holds a descriptor or more per sandbox; select() refuses
    any numbered 1024 or above (it made every create fail past ~1,170 idle
    sandboxes). With 1,500 extra descriptors open in the node's process, a
    sandbox is created, runs commands (with stdin), and is killed."""
    extra: list[int] = []
    try:
        while len(extra) < 1500:
            extra.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        assert max(extra) >= 1024
        with Sandbox.create(IMAGE, node=node) as s:
            r = s.exec("cat; echo done", stdin=b"in\n")
            assert (r.exit_code, r.stdout) == (0, b"in\ndone\n")
    finally:
        for fd in extra:
            os.close(fd)


def test_writes_stay_in_the_sandbox(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as a, Sandbox.create(IMAGE, node=node) as b:
        assert a.exec("rm /bin/busybox; echo mine > /etc/motd").exit_code == 0
        assert a.exec(["/bin/cat", "/etc/motd"]).exit_code == 127
        assert b.exec("cat /etc/motd").stdout == b"hello from the image\n"


def test_timeout_kills_the_whole_tree(sb: Sandbox) -> None:
    tag = f"{time.time_ns() % 10**9}"
    with pytest.raises(ExecTimeout) as e:
        sb.exec(f"echo started; busybox sleep 1{tag} & (busybox setsid busybox sleep 2{tag} &);"
                f" busybox sleep 3{tag}", timeout=1.0)
    assert e.value.result is not None and e.value.result.stdout == b"started\n"
    assert e.value.result.timed_out
    assert gone(tag)
    assert sb.exec("echo alive").stdout == b"alive\n"


def test_output_cap_stops_yes(sb: Sandbox) -> None:
    with pytest.raises(OutputTruncated) as e:
        sb.exec("busybox yes", max_output_bytes=100_000, timeout=60)
    assert e.value.result is not None and len(e.value.result.stdout) == 100_000
    assert sb.exec("busybox ps -o comm | grep -c yes").stdout.strip() == b"0"


def test_memory_bomb_kills_only_inside(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node, memory_mb=32) as s:
        with pytest.raises(OutOfMemory, match="32 MB") as e:
            s.exec("a=$(busybox head -c 200000000 /dev/zero | busybox tr '\\0' a); echo ${#a}",
                   timeout=60)
        assert e.value.result is not None and e.value.result.oom_killed
        assert s.exec("echo survived").stdout == b"survived\n"


def test_fork_bomb_is_held_by_the_pids_limit(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node, pids=32) as s:
        r = s.exec("for i in $(busybox seq 100); do busybox sleep 8 >/dev/null 2>&1 & done",
                   timeout=60)
        assert b"can't fork" in r.stderr
        assert int(cgroups.path("pids", s.id).joinpath("pids.max").read_text()) == 32
        try:  # with the limit reached, runc itself cannot start: a typed error
            s.exec("echo maybe")
        except QuotaExceeded as e:
            assert "process limit" in str(e)
        for pid in cgroups.pids(s.id):  # the host ends the bomb: the sandbox recovers
            if b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, 9)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                assert s.exec("echo fine").stdout == b"fine\n"
                break
            except QuotaExceeded:
                time.sleep(0.1)
        assert s.exec("echo fine").stdout == b"fine\n"


def test_full_scratch_disk(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node, disk_mb=8) as s:
        r = s.exec("busybox dd if=/dev/zero of=/big bs=1M count=20")
        assert r.exit_code != 0 and b"No space left" in r.stderr
        s.exec("rm /big")
        assert s.exec("echo ok > /small && cat /small").stdout == b"ok\n"


def test_pause_reclaims_and_resume_continues(sb: Sandbox) -> None:
    sb.exec("cat /data/big.bin > /dev/null; echo state > /tmp/s")
    figures = sb.pause()
    assert figures["before"]["cache"] > figures["after"]["cache"]
    assert figures["after"]["cache"] < 1 << 20
    assert sb.refresh().state == "paused"
    with pytest.raises(SandboxStateError, match="paused"):
        sb.exec("true")
    assert sb.files.read("/tmp/s") == b"state\n"  # files work while paused
    sb.resume()
    assert sb.exec("cat /tmp/s").stdout == b"state\n"
    with pytest.raises(SandboxStateError):
        sb.resume()


def test_kill_leaves_nothing(node: Node) -> None:
    s = Sandbox.create(IMAGE, node=node)
    d = node.config.sandboxes / s.id
    # the root lives in the sandbox's own mount namespace only: the host's
    # mount table does not grow with sandboxes
    init = node._get(s.id)[1].state.init_pid
    assert sysmount.fs_magic(f"/proc/{init}/root") == sysmount.OVERLAYFS_MAGIC
    rootfs = node.config.container_dir / s.id
    assert rootfs.is_dir() and sysmount.find_mount(rootfs) is None and cgroups.exists(s.id)
    mountinfo = Path("/proc/self/mountinfo").read_text()
    assert str(d) not in mountinfo and str(rootfs) not in mountinfo
    s.kill()
    assert not d.exists() and not rootfs.exists() and not cgroups.exists(s.id)
    assert not list(cgroups.CGROUP_ROOT.glob(f"*/{cgroups.PARENT}/{s.id}"))
    with pytest.raises(SandboxNotFound):
        s.exec("true")
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(s.id, node=node)


def test_each_sandbox_has_its_own_reads(tmp_path: Path) -> None:
    """Two sandboxes of one image share its layers' kernel mounts; each
    one's read ledger (sb.reads()) is still its own: files, touched bytes,
    trace. The daemon forgets a root once its sandbox is killed."""
    with busybox_node(tmp_path) as node:
        a = Sandbox.create(IMAGE, node=node)
        b = Sandbox.create(IMAGE, node=node)
        assert a.exec("wc -c < /data/big.bin").stdout.strip() == str(3 << 20).encode()
        assert b.exec("cat /etc/motd").stdout == b"hello from the image\n"
        ra, rb = a.reads(trace=True), b.reads(trace=True)
        assert ra.touched_bytes >= 3 << 20 and ra.files >= 2, ra.model_dump(exclude={"trace"})
        assert rb.touched_bytes < 3 << 20 and rb.files >= 2, rb.model_dump(exclude={"trace"})
        assert ra.trace is not None and rb.trace is not None
        assert a.reads().trace is None  # only when asked for
        traced_a, traced_b = {e.path for e in ra.trace}, {e.path for e in rb.trace}
        assert "data/big.bin" in traced_a and "etc/motd" not in traced_a
        assert "etc/motd" in traced_b and "data/big.bin" not in traced_b
        roots = {str(node.config.container_dir / s.id) for s in (a, b)}
        a.kill()
        b.kill()
        watches = request(node.images.paths, {"op": "stats"})["stats"]["open_watches"]
        assert not roots & set(watches), watches


def test_bad_input(node: Node) -> None:
    with pytest.raises(ImageNotFound, match="nope:1"):
        Sandbox.create("nope:1", node=node)
    with pytest.raises(InvalidSpec, match="cpu"):
        Sandbox.create(IMAGE, node=node, cpu=-1)
    assert not list(node.config.sandboxes.iterdir()) or all(
        (d / "sandbox.json").exists() for d in node.config.sandboxes.iterdir())


def test_labels_bulk_pause_and_kill(node: Node) -> None:
    boxes = [Sandbox.create(IMAGE, node=node, labels={"job": "bulk", "i": str(i)})
             for i in range(3)]
    other = Sandbox.create(IMAGE, node=node, labels={"job": "other"})
    try:
        assert {s.id for s in Sandbox.list({"job": "bulk"}, node=node)} == {b.id for b in boxes}
        assert sorted(Sandbox.pause_many({"job": "bulk"}, node=node)) == sorted(
            b.id for b in boxes)
        assert {s.info.state for s in Sandbox.list({"job": "bulk"}, node=node)} == {"paused"}
        assert other.refresh().state == "running"
        assert Sandbox.resume_many({"job": "other"}, node=node) == []  # it was not paused
        assert sorted(Sandbox.resume_many({"job": "bulk"}, node=node)) == sorted(
            b.id for b in boxes)
        assert {s.info.state for s in Sandbox.list({"job": "bulk"}, node=node)} == {"running"}
        assert boxes[0].exec("echo thawed").stdout == b"thawed\n"
        assert Sandbox.pause_many({"i": "1"}, node=node) == [boxes[1].id]
        assert asyncio.run(AsyncSandbox.resume_many({"i": "1"}, node=node)) == [boxes[1].id]
        assert len(Sandbox.kill_many({"job": "bulk"}, node=node)) == 3
        assert Sandbox.list({"job": "bulk"}, node=node) == []
    finally:
        other.kill()


def test_best_effort_runs_under_sched_idle(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node, qos="best_effort") as s:
        policy = s.exec("cat /proc/self/stat").stdout.rsplit(b")", 1)[1].split()[38]
        assert policy == b"5"  # SCHED_IDLE
    with Sandbox.create(IMAGE, node=node) as s:
        assert s.exec("cat /proc/self/stat").stdout.rsplit(b")", 1)[1].split()[38] == b"0"


def test_timeouts_reap_sandboxes(node: Node) -> None:
    short = Sandbox.create(IMAGE, node=node, timeout=0.5)
    idle = Sandbox.create(IMAGE, node=node, idle_timeout=0.5)
    busy = Sandbox.create(IMAGE, node=node, idle_timeout=0.5)
    try:
        time.sleep(0.7)  # the test: the 0.5 s timeouts expire
        busy.exec("true")
        reaped = node.reaper.reap()
        assert short.id in reaped and idle.id in reaped and busy.id not in reaped
        with pytest.raises(SandboxNotFound):
            short.exec("true")
    finally:
        busy.kill()


def test_a_new_node_finds_running_sandboxes(node: Node, tmp_path: Path) -> None:
    config = RuntimeConfig(store=node.config.store, cluster=None, state_dir=tmp_path / "state",
                           node_root=node.config.node_root)
    first = Node(config)
    try:
        s = Sandbox.create(IMAGE, node=first)
        s.exec("echo before > /tmp/mark")
        backend = first.backend("container")
        assert isinstance(backend, ContainerBackend)
        audit = backend.denials.audit is not None
        with pytest.raises(BackendUnavailable, match="owns"):
            Node(config)  # one node process per state directory
    except BaseException:
        first.kill_many(None)
        raise
    finally:
        first.close()  # the process goes; its sandboxes stay
    second = Node(config)
    try:
        again = Sandbox.connect(s.id, node=second)
        assert again.exec("cat /tmp/mark").stdout == b"before\n"
        # its Landlock refusals are the new node's to record: a signal to
        # init (outside the command's domain) is refused and is an event
        assert again.exec("kill -0 1; echo rc=$?").stdout == b"rc=1\n"
        if audit:  # (else the node's log says why Landlock denials go unrecorded)
            wait_until(lambda: ("tampering", "scope.signal") in
                       {(e.kind, e.detail) for e in again.events()}, 5, "a tampering event")
    finally:
        second.kill_many(None)
        second.close()


def test_a_moved_tag_does_not_change_a_sandbox(node: Node, tmp_path: Path) -> None:
    """The image name is resolved once, at create: a tag re-pointed later
    changes neither a running sandbox nor one a restarted node recovers; new
    sandboxes get the new image."""
    first, second = node.images.resolve(IMAGE), node.images.resolve(SECOND)
    store = node.config.store
    retag(store, "moving:1", IMAGE)
    config = RuntimeConfig(store=store, cluster=None, state_dir=tmp_path / "state",
                           node_root=node.config.node_root)
    old = Node(config)
    try:
        s = Sandbox.create("moving:1", node=old)
        assert s.info.image_digest == first and s.info.spec.image == "moving:1"
        retag(store, "moving:1", SECOND)
        assert s.exec("cat /etc/motd").stdout == b"hello from the image\n"
        assert Sandbox.connect(s.id, node=old).info.image_digest == first
        with Sandbox.create("moving:1", node=old) as new:
            assert new.info.image_digest == second
            assert new.exec("cat /etc/motd").stdout == SECOND_MOTD
    except BaseException:
        old.kill_many(None)
        raise
    finally:
        old.close()  # its sandbox stays, recorded with its digest
    saved = (config.sandboxes / s.id / "sandbox.json").read_text()
    assert first in saved and second not in saved
    retag(store, "moving:1", None)  # the name is gone: recovery does not need it
    restarted = Node(config)
    try:
        again = Sandbox.connect(s.id, node=restarted)
        assert again.info.image_digest == first
        assert again.exec("cat /etc/motd").stdout == b"hello from the image\n"
    finally:
        restarted.kill_many(None)
        restarted.close()


def test_async_sandbox_under_asyncio_and_trio(node: Node) -> None:
    async def rollout() -> bytes:
        async with await AsyncSandbox.create(IMAGE, node=node) as s:
            await s.files.write("/tmp/x", b"async")
            r = await s.exec("cat /tmp/x")
            return r.stdout

    assert asyncio.run(rollout()) == b"async"
    assert trio.run(rollout) == b"async"

    async def many() -> list[int]:
        boxes = await asyncio.gather(*[AsyncSandbox.create(IMAGE, node=node) for _ in range(4)])
        try:
            rs = await asyncio.gather(*[b.exec("echo $$") for b in boxes])
            return [r.exit_code for r in rs]
        finally:
            await asyncio.gather(*[b.kill() for b in boxes])

    assert asyncio.run(many()) == [0, 0, 0, 0]


def test_network_allowlist(node: Node) -> None:
    servers = [ThreadingHTTPServer(("0.0.0.0", 0), Hello) for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    allowed, denied = (srv.server_address[1] for srv in servers)
    try:
        policy = NetworkPolicy.allow_only(f"node:{allowed}")
        with Sandbox.create(IMAGE, node=node, network=policy) as s:
            host = s.info.host_address  # the node's side of this sandbox's network
            assert host is not None and host != "10.203.0.1"  # slot 0 is never handed out
            assert Sandbox.connect(s.id, node=node).info.host_address == host
            # (busybox 1.35's wget crashes with -q; its progress goes to stderr)
            r = s.exec(f"busybox wget -O - http://{host}:{allowed}/")
            assert r.stdout == b"mirror says hi", r
            t0 = time.monotonic()
            r = s.exec(f"busybox wget -O - http://{host}:{denied}/")
            assert r.exit_code != 0 and time.monotonic() - t0 < 3  # rejected, not hanging
            assert s.exec("busybox ip route add 1.0.0.0/8 dev eth0").exit_code != 0
            with Sandbox.create(IMAGE, node=node, network=policy) as other:
                # a sandbox listening on the allowed port is still unreachable
                # for its neighbours: nothing may connect in
                other_ip = other.info.host_address
                assert other_ip is not None and other_ip != host
                # `node` allowed only this sandbox's own node side: the
                # neighbour's node side is another address, refused at once
                r = s.exec(f"busybox wget -O - http://{other_ip}:{allowed}/")
                assert r.exit_code != 0 and b"mirror" not in r.stdout
                other_ip = other_ip[:-1] + str(int(other_ip[-1]) + 1)  # its side of the /30
                listener = threading.Thread(target=lambda: other.exec(
                    f"busybox nc -l -p {allowed} -w 3", timeout=10))
                listener.start()
                wait_until(lambda: any(tcp_listening(pid, allowed) for pid in
                                       processes_with(f"nc\0-l\0-p\0{allowed}\0")),
                           20, "the neighbour's nc listening")
                r = s.exec(f"echo hi | busybox nc -w 2 {other_ip} {allowed}")
                assert r.exit_code != 0
                listener.join()
        assert not [n for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else [])
                    if n.startswith("lzsb-")]
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()

