"""What a node does per sandbox must not grow with the sandboxes it holds:
the pieces of a create and a kill that once did, each checked by the
effect that grew (no timings)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Sandbox
from runtime.errors import OutOfMemory
from runtime.isolation import cgroups, oci
from runtime.isolation.denials import DenialLog, SeccompListener
from runtime.node import Node
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, runtime_missing
from tests.helpers.support import wait_until

needs_runtime = [pytest.mark.root,
                 pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    if runtime_missing() is not None:
        pytest.skip(str(runtime_missing()))
    d = tmp_path_factory.mktemp("scale")
    with node_for(busybox_store(d), d) as n:
        yield n


def _child_fds() -> set[str]:
    """The descriptors a process the node spawns inherits (runc, nsenter:
    posix_spawn keeps every descriptor not marked close-on-exec)."""
    out = subprocess.run(["/bin/sh", "-c", "ls /proc/$$/fd"], close_fds=False,
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_seccomp_listener_descriptors_are_not_inherited(tmp_path: Path) -> None:
    """Each container hands the node its seccomp notification descriptor.
    Received inheritable, every runc the node started held one per sandbox
    on the node (3,000 at 3,000 idle sandboxes, each marked close-on-exec by
    runc in turn). Here 40 "sandboxes" hand the listener a descriptor (a
    pipe's: the listener only polls it); a child spawned afterwards inherits
    none of them."""
    listener = SeccompListener(tmp_path / "seccomp.sock", DenialLog())
    pipes = [os.pipe() for _ in range(40)]
    try:
        before = _child_fds()
        for i, (r, _) in enumerate(pipes):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.connect(str(listener.path))
                socket.send_fds(c, [f'{{"state": {{"id": "sb-{i}"}}}}'.encode()], [r])
        deadline = time.monotonic() + 10
        while len(listener._sandbox_of) < len(pipes) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(listener._sandbox_of) == len(pipes)
        for r, _ in pipes:
            os.close(r)  # the listener's copies stay
        grown = _child_fds() - before
        assert not grown, f"a spawned process inherited {len(grown)} of the listener's " \
                          f"descriptors"
    finally:
        listener.close()
        for r, w in pipes:
            os.close(w)


def _superblocks(mountinfo: str) -> dict[str, list[str]]:
    """device (major:minor) -> the mount points with a mount of it"""
    out: dict[str, list[str]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        out.setdefault(fields[2], []).append(fields[4])
    return out


@pytest.mark.root
def test_masked_sys_directories_add_no_superblock_per_sandbox(node: Node) -> None:
    """Whenever a memory cgroup goes (every kill), the kernel walks every
    superblock's memcg-aware lists (memcg_reparent_list_lrus): the more
    superblocks the node's sandboxes hold, the dearer each kill, and the walk
    runs in kernel workers that take CPU from the next creates. runc masks
    each directory with a tmpfs of its own (5 of a sandbox's 15 superblocks
    here), and /sys/fs/cgroup was another; they are binds of directories of
    the node's now. A sandbox adds at most its overlay, proc, sysfs, /dev,
    devpts, shm, mqueue and /proc/acpi (a tmpfs: runc binds nothing inside
    /proc); the masks still read as empty and refuse writes."""
    masked = [d for d in oci.SYS_MASKED_DIRS if Path(d).is_dir()]
    assert masked  # the host has some of them: the test checks their masks
    with Sandbox.create(IMAGE, node=node) as sb:
        init = node._sandboxes[sb.id][1].state.init_pid
        host = set(_superblocks(Path("/proc/self/mountinfo").read_text()))
        mounts = _superblocks(Path(f"/proc/{init}/mountinfo").read_text())
        own = {dev: points for dev, points in mounts.items() if dev not in host}
        mask_devs = {dev for dev, points in mounts.items() if set(points) & set(masked)}
        # one superblock for every mask, and the node's, not the sandbox's
        assert len(mask_devs) == 1 and mask_devs <= host, mask_devs
        assert len(own) <= 8, own
        for d in masked:
            r = sb.exec(f"ls -A {d} | wc -l; touch {d}/x 2>/dev/null; echo rc=$?")
            assert r.stdout.split() == [b"0", b"rc=1"], (d, r)


@pytest.mark.root
def test_a_create_mounts_no_cgroup_hierarchy(node: Node) -> None:
    """runc's "cgroup" mount is one cgroup1 mount(2) per hierarchy (9 here),
    and each walks every cgroup of the host's v2 tree, one per sandbox, and
    waits until the dying ones of sandboxes just killed are gone
    (cgroup_lock_and_drain_offline: 4 % of all CPU samples at 3,000 idle
    sandboxes, perf). The sandbox's groups are read-only binds now. This
    kernel refuses kprobes and function tracing, so the test cannot count
    the kernel's calls: it checks that the config runc gets asks for no
    cgroup mount, and that the sandbox still reads its own limits in every
    hierarchy and cannot change them."""
    with Sandbox.create(IMAGE, node=node, memory_mb=300) as sb:
        config = json.loads((node.config.sandboxes / sb.id / "config.json").read_text())
        assert [m for m in config["mounts"] if m["type"] == "cgroup"] == []
        r = sb.exec("cat /sys/fs/cgroup/memory/memory.limit_in_bytes; "
                    "cat /sys/fs/cgroup/pids/pids.max; cat /proc/self/cgroup | wc -l; "
                    "echo 1 > /sys/fs/cgroup/memory/memory.limit_in_bytes; echo rc=$?")
        listed = sb.exec("ls /sys/fs/cgroup").stdout.split()
    assert r.stdout.split() == [str(300 << 20).encode(), str(sb.info.spec.pids).encode(),
                                str(len(cgroups.v1_hierarchies()) + 1).encode(), b"rc=1"], r
    assert [x.decode() for x in listed] == list(cgroups.v1_hierarchies())


def _group_inode(sandbox_id: str) -> int:
    return cgroups.path("memory", sandbox_id).stat().st_ino


@pytest.mark.root
def test_a_killed_sandboxs_groups_serve_the_next_one_clean(node: Node) -> None:
    """Removing a memory cgroup walks every superblock's lists on the host
    (~12 ms of kernel CPU per kill at 3,000 idle sandboxes): a kill hands
    the emptied groups to the next create instead (cgroups.GroupPool). The
    next sandbox must not see anything of the earlier one: not its name, CPU
    time, idle cpu class or freezer state, nor its OOM kill (a group with
    one on record is removed, not reused).

    The kernel flushes memory.stat's per-type figures lazily (every 2 s):
    the first sandbox lives past a flush, so that right after its kill they
    still show its processes' anonymous memory (a pool that judged by them
    pooled its groups by chance: CI failed on it)."""
    with Sandbox.create(IMAGE, node=node, qos="best_effort") as first:
        first.exec("i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done", timeout=120)
        wait_until(lambda: cgroups.memory_stat(first.id)["rss"] > 0, 10,
                   "the kernel's memory.stat flush")
        old, old_id, used = _group_inode(first.id), first.id, cgroups.cpu_usage(first.id)
        assert cgroups.cpu_idle(first.id)
    assert not list(cgroups.CGROUP_ROOT.glob(f"*/{cgroups.PARENT}/{old_id}"))
    with Sandbox.create(IMAGE, node=node) as second:
        assert _group_inode(second.id) == old  # the same group, renamed
        r = second.exec("cat /sys/fs/cgroup/cpuacct/cpuacct.usage /sys/fs/cgroup/cpu/cpu.idle "
                        "/sys/fs/cgroup/freezer/freezer.state; grep memory /proc/self/cgroup")
        usage, idle, freezer = r.stdout.split()[:3]
        assert int(usage) / 1e9 < used / 2 and idle == b"0" and freezer == b"THAWED", (r, used)
        assert not cgroups.cpu_idle(second.id)
        assert cgroups.path("memory", second.id).is_dir()
    with Sandbox.create(IMAGE, node=node, memory_mb=32) as second:
        with pytest.raises(OutOfMemory):
            second.exec("a=$(busybox head -c 200000000 /dev/zero | busybox tr '\\0' a); "
                        "echo ${#a}", timeout=60)
        assert cgroups.oom_kills(second.id) >= 1
        oomed = _group_inode(second.id)
    with Sandbox.create(IMAGE, node=node) as third:
        assert _group_inode(third.id) != oomed and cgroups.oom_kills(third.id) == 0
        assert [e for e in third.events() if e.kind == "oom_kill"] == []


@pytest.mark.root
def test_the_spawner_gives_a_program_only_its_descriptors(tmp_path: Path) -> None:
    """The node holds descriptors per sandbox; what it starts through the
    spawner (runc) gets exactly the ones asked for, at the numbers asked
    for, and its exit status; a program past its timeout is killed."""
    from runtime.isolation.spawner import Spawner
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(50)]  # inheritable
    sp = Spawner()
    try:
        out = tmp_path / "out"
        with open(out, "wb") as f:
            code = sp.run(["/bin/sh", "-c", "ls /proc/$$/fd; exit 7"],
                          {1: f.fileno(), 9: held[0]}, timeout=30)
        assert code == 7
        assert set(out.read_text().split()) <= {"0", "1", "2", "9", "255"}, out.read_text()
        assert "9" in out.read_text().split()
        t0 = time.monotonic()
        assert sp.run(["/bin/sleep", "60"], {}, timeout=0.5) == -9
        assert time.monotonic() - t0 < 20
    finally:
        sp.close()
        for fd in held:
            os.close(fd)



@pytest.mark.root
def test_a_fresh_nodes_first_creates_may_run_at_once(tmp_path: Path) -> None:
    """The first create of a node sets up the sandbox-init view every
    container binds (a tmpfs and a copy of the binary, shared by the nodes
    of a host): eight first creates at once, in threads of one node, all
    get the same complete, executable copy, on one tmpfs (one of four
    threads creating on a fresh node once failed on another's half-done
    copy)."""
    import threading

    from runtime.backends.container import _init_view
    from runtime.native import sandbox_init
    built = sandbox_init(tmp_path / "bin")
    for round_ in range(3):
        d = tmp_path / f"r{round_}" / "init"
        d.parent.mkdir()
        gate = threading.Barrier(8)
        got: list[object] = []

        def first(d: Path, gate: threading.Barrier, got: list[object]) -> None:
            gate.wait()
            try:
                got.append(_init_view(d, built))
            except Exception as e:  # noqa: BLE001 - the test reports it
                got.append(e)
        threads = [threading.Thread(target=first, args=(d, gate, got)) for _ in range(8)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert got == [d / built.name] * 8, got
            assert (d / built.name).read_bytes() == built.read_bytes()
            assert os.access(d / built.name, os.X_OK)
            mounts = [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines()
                      if ln.split()[4] == str(d)]
            assert len(mounts) == 1, mounts
        finally:
            while subprocess.run(["umount", str(d)], check=False, capture_output=True).returncode == 0:
                pass
