"""Snapshot, fork, hidden paths and verify on container sandboxes: real
runc, real overlayfs uppers packed into layers of a real chunk store, and
restored through the lazyfs daemon's kernel path.

What a user checks: a sandbox restored from a snapshot shows exactly the
parent's files (content, deletions, metadata, links, holes, xattrs); forks are
independent and have their own identity; hidden paths are invisible to the
agent and the image's own version appears to the verifier whatever the
agent wrote; the verifier runs none of the agent's processes."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from composer.errors import ImageNotFound
from composer.manifest import Kind
from composer.snapshot import UNTRUSTED, HostIds
from runtime import (
    InvalidSpec,
    Sandbox,
    SandboxNotFound,
    SandboxPreempted,
    SandboxStateError,
    SnapshotInfo,
    Unsupported,
)
from runtime.backends.container import ContainerBackend
from runtime.config import RuntimeConfig
from runtime.isolation import cgroups
from runtime.node import Node
from runtime.spec import ExecRequest, build
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, runtime_missing
from tests.helpers.snapshots import kill_snapshot_midway

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("snap")
    with node_for(busybox_store(d), d) as n:
        yield n


def rootfs(node: Node, sb: Sandbox) -> Path:
    """The sandbox's root as the host reaches it."""
    backend = node.backend("container")
    assert isinstance(backend, ContainerBackend)
    return backend.root(node._get(sb.id)[1])


SKIP_TOP = {"proc", "sys", "dev"}  # the container's own mounts, not its files


def seen(node: Node, sb: Sandbox) -> dict[str, tuple[Any, ...]]:
    """tree() of the sandbox's root, owners as the sandbox sees them (its
    user namespace maps its ids to a host range of its own)."""
    ids = node._get(sb.id)[1].state.host_ids()
    return tree(rootfs(node, sb), ids)


def tree(root: Path, ids: HostIds | None = None) -> dict[str, tuple[Any, ...]]:
    """Everything a process sees of each path under root, from the host
    (ids: owners shifted back to the sandbox's ids)."""
    def inside(n: int) -> int:
        return n if ids is None else ids.inside(n)

    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in SKIP_TOP]
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(full)
            xattrs = tuple(sorted((n, os.getxattr(full, n, follow_symlinks=False))
                                  for n in os.listxattr(full, follow_symlinks=False)
                                  if n.startswith("user.")))
            what: Any = None
            if stat.S_ISREG(st.st_mode):
                with open(full, "rb") as f:
                    # (holes: EROFS reports a file's blocks as if it had none;
                    # the packed layer's holes are checked below)
                    what = (hashlib.sha256(f.read()).hexdigest(), st.st_nlink)
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(full)
            elif stat.S_ISDIR(st.st_mode):
                what = "dir"
            # (a directory's size and mtime are its filesystem's business)
            plain = not stat.S_ISDIR(st.st_mode)
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), inside(st.st_uid),
                        inside(st.st_gid),
                        st.st_size if plain else None, st.st_mtime_ns if plain else None, what,
                        xattrs)
    return out


def same_tree(got: dict[str, tuple[Any, ...]], want: dict[str, tuple[Any, ...]]) -> None:
    """The same paths, each the same in every respect (the first difference named)."""
    assert set(got) == set(want), set(got) ^ set(want)
    for path, value in want.items():
        assert got[path] == value, path


CHANGES = """
set -e
echo new > /root/new.txt
head -c 1048576 /dev/urandom > /root/random.bin
rm /etc/motd
rm -rf /data && mkdir /data && echo replaced > /data/other
chmod 600 /etc/image-name
chown 1000:1000 /etc/passwd 2>/dev/null || chown 1000:1000 /bin/busybox
touch -d '2001-02-03 04:05:06' /root/new.txt
ln /root/new.txt /root/hard
ln -s ../root/new.txt /etc/link
dd if=/dev/urandom of=/root/sparse bs=4096 count=1 seek=1000 2>/dev/null
mkfifo /root/fifo
mkdir -p /opt/deep/er && echo x > /opt/deep/er/f
"""


def changed_and_snapshotted(node: Node, sb: Sandbox) -> tuple[dict[str, tuple[Any, ...]],
                                                              SnapshotInfo]:
    """CHANGES (and a user xattr) made in sb, then (its tree as the host
    sees it, its snapshot)."""
    r = sb.exec(CHANGES)
    assert r.exit_code == 0, r.stderr
    os.setxattr(rootfs(node, sb) / "root" / "new.txt", "user.test", b"value")
    want = seen(node, sb)
    return want, sb.snapshot()


def test_a_restored_snapshot_shows_exactly_the_parents_files(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        want, snap = changed_and_snapshotted(node, sb)
        assert snap.frozen_s < 5 and snap.entries > 10 and snap.bytes >= 1 << 20
        assert snap.tag == f"snapshots/{sb.id}:1"
        with Sandbox.create(snap, node=node) as child:
            assert child.info.image_digest == snap.image
            got = seen(node, child)
    same_tree(got, want)
    assert "etc/motd" not in got and "data/big.bin" not in got  # deletions held


def test_snapshot_layer_is_untrusted_and_deduplicated(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        # the image's own bytes written again by the sandbox, and new bytes
        sb.exec("cp /data/big.bin /root/copy.bin; head -c 300000 /dev/urandom > /root/new")
        first = sb.snapshot()
        sb.exec("echo more > /root/more")
        second = sb.snapshot(tag="mine/snap:two")
    assert first.bytes_new < (1 << 20)  # the 3 MiB copy deduplicated (by BLAKE3)
    assert second.bytes_new < 4096  # only what changed is new
    assert second.tag == "mine/snap:two"
    store, cat = node.captures._open()  # the process's one environment of the store
    m = cat.load_layer(first.layer)
    assert m.domain == UNTRUSTED
    base = cat.load_layer(cat.resolve(IMAGE)[1].layers[0])
    assert str(base.domain) == "trusted"
    copy = next(e for e in m.entries if e.path == "root/copy.bin")
    big = next(e for e in base.entries if e.path == "data/big.bin")
    assert [c.id for c in copy.chunks] == [c.id for c in big.chunks]
    # the chunks read back in each domain are the image's bytes
    ids = [c.id for c in copy.chunks if c.id is not None]
    assert store.get_many(ids, UNTRUSTED) == store.get_many(ids, base.domain)
    assert cat.resolve("mine/snap:two")[0] == second.image


def test_fork_children_are_independent_with_their_own_identity(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        sb.exec("echo parent-id-0000000000000000000000 > /etc/machine-id; "
                "echo parent > /etc/hostname; echo state > /root/state")
        kids = sb.fork(3)
        try:
            names = [k.exec("hostname").stdout.strip() for k in kids]
            assert names == [k.id.encode() for k in kids]
            ids = {k.files.read("/etc/machine-id") for k in kids}
            assert len(ids) == 3 and b"parent-id-0000000000000000000000\n" not in ids
            assert all(k.files.read("/etc/hostname") == k.id.encode() + b"\n" for k in kids)
            assert all(k.files.read("/root/state") == b"state\n" for k in kids)
            kids[0].exec("echo mine > /root/state")
            assert kids[1].files.read("/root/state") == b"state\n"
            assert sb.files.read("/root/state") == b"state\n"
            assert sb.files.read("/etc/hostname") == b"parent\n"
        finally:
            for k in kids:
                k.kill()


def test_hidden_paths_and_a_verifier_the_agent_cannot_touch(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node, hidden=["/data"]) as sb:
        assert sb.exec("ls /data").exit_code != 0  # not there for the agent
        # the agent plants its own "answers", replaces the shell and leaves a process
        sb.exec("mkdir -p /data && echo forged > /data/big.bin; echo 42 > /root/answer; "
                "cp /bin/busybox /root/busybox")
        sb.exec("setsid sleep 300 </dev/null >/dev/null 2>&1 &")
        sb.exec("rm -f /bin/sh")
        sb.files.write("/bin/sh", b"#!/root/busybox sh\necho PASS; exit 0\n", mode=0o755)
        with open(Path(node.config.store).parent / "rootfs" / "data" / "big.bin", "rb") as f:
            real = hashlib.sha256(f.read()).hexdigest().encode()
        # whole writable layer: the agent's answer and its shell come along
        r = sb.verify(["/bin/busybox", "sh", "-c",
                       ("sha256sum /data/big.bin; cat /root/answer; ps -o args; "
                       "ip -o link 2>/dev/null | wc -l")])
        assert r.exit_code == 0, r.stderr
        assert r.stdout.startswith(real)  # the image's file, not the agent's
        assert b"42\n" in r.stdout
        assert b"sleep 300" not in r.stdout  # no process of the agent's
        assert sb.verify("true").stdout == b"PASS\n"  # its /bin/sh came along
        # keep: only the agent's /root; /bin/sh is the image's again
        r = sb.verify("cat /root/answer; sha256sum /data/big.bin; exit 3", keep=["/root"])
        assert (r.exit_code, r.stdout.split()[:2]) == (3, [b"42", real])
        # the agent's own view did not change, and no verifier is left
        assert sb.files.read("/data/big.bin") == b"forged\n"
        assert [i.id for i in Sandbox.list(node=node)] == [sb.id]


def test_a_verifier_reveals_the_images_files_not_a_snapshots(node: Node) -> None:
    """Hidden paths come back from the image's trusted layers only: what an
    agent wrote at a hidden path before a snapshot (its layer is below the
    new sandbox's, but sandbox-written) is not what the grader sees."""
    with open(Path(node.config.store).parent / "rootfs" / "data" / "big.bin", "rb") as f:
        real = hashlib.sha256(f.read()).hexdigest().encode()
    with Sandbox.create(IMAGE, node=node) as sb:
        sb.exec("echo forged > /data/big.bin; echo planted > /data/answer")
        snap = sb.snapshot()
    with Sandbox.create(snap, node=node, hidden=["/data"]) as sb:
        assert sb.exec("ls /data").exit_code != 0
        r = sb.verify("sha256sum /data/big.bin; ls /data")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.startswith(real), r.stdout  # the image's, not the snapshot's
        assert b"answer" not in r.stdout


def test_bad_requests(node: Node) -> None:
    with pytest.raises(InvalidSpec, match="hidden"):
        Sandbox.create(IMAGE, node=node, hidden=["relative"])
    with pytest.raises(InvalidSpec, match="not in the image"):
        Sandbox.create(IMAGE, node=node, hidden=["/no/such"])
    with pytest.raises(Unsupported, match="fncall"):
        Sandbox.create(IMAGE, backend="fncall", node=node, hidden=["/data"])
    with Sandbox.create(IMAGE, backend="fncall", node=node) as fn, \
            pytest.raises(Unsupported, match="snapshot"):
        fn.snapshot()
    with Sandbox.create(IMAGE, node=node) as sb, pytest.raises(InvalidSpec, match="tag"):
        sb.snapshot(tag="Bad Name!")


def test_pack_diff_entries_from_a_real_upper(node: Node) -> None:
    """The packed layer itself: whiteouts, an opaque directory, a link."""
    with Sandbox.create(IMAGE, node=node) as sb:
        sb.exec("rm /etc/motd; rm -rf /data; mkdir /data; ln /etc/image-name /etc/again; "
                "dd if=/dev/urandom of=/root/sparse bs=4096 count=1 seek=1000 2>/dev/null")
        snap = sb.snapshot()
    _, cat = node.captures._open()
    m = cat.load_layer(snap.layer)
    kinds = {e.path: e for e in m.entries}
    assert kinds["etc/motd"].kind == Kind.WHITEOUT
    assert kinds["data"].kind == Kind.DIR and kinds["data"].opaque
    assert {kinds["etc/again"].kind, kinds["etc/image-name"].kind} == {Kind.FILE, Kind.HARDLINK}
    assert not any(n.startswith("trusted.overlay.") for e in m.entries for n in e.xattrs)
    sparse = kinds["root/sparse"]  # a hole stays a hole: no chunk stored for it
    assert sparse.size == 1001 * 4096 and sparse.chunks[0].id is None
    assert sum(c.length for c in sparse.chunks if c.id is not None) <= 256 << 10


def test_preempt_and_restore_on_one_node_with_a_local_store(node: Node) -> None:
    labels = {"job": "local-preempt"}
    sb = Sandbox.create(IMAGE, node=node, labels=labels)
    sb.exec("echo kept > /root/kept; rm /etc/motd")
    ids = Sandbox.pause_many(labels, snapshot=True, node=node)
    assert ids == [sb.id]
    assert Sandbox.list(labels, node=node) == []
    assert not (node.config.sandboxes / sb.id).exists()  # its writable layer went
    with pytest.raises(SandboxPreempted):
        sb.refresh()
    [record] = Sandbox.preempted(labels, node=node)
    assert (record.id, record.spec.labels, record.image_digest) == (
        sb.id, labels, sb.info.image_digest)
    assert Sandbox.restore_many(labels, node=node) == [sb.id]
    try:
        back = Sandbox.connect(sb.id, node=node)
        assert back.files.read("/root/kept") == b"kept\n"
        assert back.exec("test -e /etc/motd").exit_code == 1
        assert Sandbox.preempted(labels, node=node) == []
        with pytest.raises(SandboxStateError, match="runs on this node"):
            Sandbox.restore(sb.id, node=node)
    finally:
        Sandbox.kill_many(labels, node=node)
    with pytest.raises(SandboxNotFound, match="no preempted sandbox"):
        Sandbox.restore(sb.id, node=node)
    # a preempted sandbox that is not wanted any more: kill discards it
    again = Sandbox.create(IMAGE, node=node, labels=labels)
    record = again.preempt()
    again.kill()
    assert Sandbox.preempted(labels, node=node) == []
    with pytest.raises(ImageNotFound):
        node.captures._open()[1].resolve(record.tag)
    with pytest.raises(SandboxNotFound):
        again.kill()


def test_a_kill_during_a_restore_stops_the_restored_sandbox(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill(id) while restore(id) is making the container (a fleet-wide
    kill_many during a drain --move, say): the kill waits for the restore
    and stops what it made; nothing of the sandbox keeps running. The
    backend's real create is only held at its start (an event), so the
    kill lands while the restore is under way every time."""
    sb = Sandbox.create(IMAGE, node=node, labels={"job": "kill-restoring"})
    sb.preempt()
    backend = node.backend("container")
    real_create = backend.create
    started, release = threading.Event(), threading.Event()

    def held_create(h: Any) -> None:
        started.set()
        assert release.wait(30)
        real_create(h)
    monkeypatch.setattr(backend, "create", held_create)
    errors: list[Exception] = []

    def run(fn: Any) -> None:
        try:
            fn(sb.id)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
    restore = threading.Thread(target=run, args=(node.restore,))
    restore.start()
    assert started.wait(30)
    kill = threading.Thread(target=run, args=(node.kill,))
    kill.start()
    kill.join(0.5)
    release.set()
    restore.join(60)
    kill.join(60)
    try:
        assert not errors, errors
        assert sb.id not in {i.id for i in node.list_sandboxes()}, \
            "the restored sandbox runs on after its kill"
        assert not cgroups.exists(sb.id)
        assert not (node.config.sandboxes / sb.id).exists()
        assert Sandbox.preempted({"job": "kill-restoring"}, node=node) == []
    finally:
        if sb.id in {i.id for i in node.list_sandboxes()}:
            node.kill(sb.id)


def test_a_snapshot_killed_midway_leaves_no_tag_and_no_broken_chunk(
        node: Node, tmp_path: Path) -> None:
    store, catalog = node.captures._open()
    tags = catalog.list_tags()
    config = RuntimeConfig(store=node.config.store, cluster=None, state_dir=tmp_path / "state",
                           node_root=node.config.node_root)
    sandbox_id = kill_snapshot_midway(store=config.store, cluster=None,
                                      state=config.state_dir, node_root=config.node_root,
                                      image=IMAGE, tag="killed/midway:1", watch=config.store)
    assert catalog.list_tags() == tags
    with pytest.raises(ImageNotFound):
        catalog.resolve("killed/midway:1")
    report = store.verify()  # every chunk the index names is whole and matches its id
    assert report.ok, report
    other = Node(config)  # the killed node's sandbox: thawed, it runs on
    try:
        assert other.get(sandbox_id).state == "running"
        assert other.exec(sandbox_id, build(ExecRequest, cmd=("cat", "/root/alive"))
                          ).stdout == b"alive\n"
    finally:
        for info in other.list_sandboxes():
            other.kill(info.id)
        other.close()


def test_a_preemption_killed_after_its_record_is_finished_at_the_next_start(
        node: Node, tmp_path: Path) -> None:
    config = RuntimeConfig(store=node.config.store, cluster=None, state_dir=tmp_path / "state",
                           node_root=node.config.node_root)
    records = config.state_dir / "preempted"  # where a local node keeps them

    sandbox_id = kill_snapshot_midway(store=config.store, cluster=None,
                                      state=config.state_dir, node_root=config.node_root,
                                      image=IMAGE, tag="-", watch=records, preempt=True)
    other = Node(config)  # the preemption is finished: the sandbox does not run here
    try:
        assert other.list_sandboxes() == []
        assert not (config.sandboxes / sandbox_id).exists()
        back = Sandbox.restore(sandbox_id, node=other)  # and it comes back whole
        assert back.files.read("/root/alive") == b"alive\n"
    finally:
        for info in other.list_sandboxes():
            other.kill(info.id)
        other.close()


def test_a_chain_is_flattened_with_a_local_store(node: Node, tmp_path: Path) -> None:
    shallow = Node(RuntimeConfig(store=node.config.store, cluster=None,
                                 state_dir=tmp_path / "state", node_root=node.config.node_root,
                                 max_snapshot_layers=1))
    try:
        with Sandbox.create(IMAGE, node=shallow) as sb:
            sb.exec("echo 1 > /root/one; rm /etc/motd")
            first = sb.snapshot()
        with Sandbox.create(first, node=shallow) as sb:
            sb.exec("echo 2 > /root/two; rm /root/one")
            want = seen(shallow, sb)
            second = sb.snapshot()
        assert (first.layers, first.flattened, second.layers, second.flattened) == (2, 0, 2, 2)
        with Sandbox.create(second, node=shallow) as sb:
            same_tree(seen(shallow, sb), want)
    finally:
        shallow.close()
