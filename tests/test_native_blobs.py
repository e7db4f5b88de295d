"""The native data path: layers' blobs served by lazyfs-blobd (lazyfs/nativeblobs.py,
lazyfs/native/blobd.c) under real kernel EROFS mounts and overlayfs.

What a user checks: the bytes are the image's, the figures (per mount, the
trace) are the Python path's, nobody but the server is listened to, a
dead or confused server gives errors and never wrong bytes, and the server
stays clean under AddressSanitizer + UBSan and against malformed tables.
Real mounts, a real daemon, the real server; the only fault injected by
hand is a flipped byte in a file (a disk the real thing cannot make lie on
demand) and SIGKILL."""

from __future__ import annotations

import errno
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import open_object_store
from composer.catalog import Catalog
from composer.push import push
from composer.remote import ClusterCatalog
from lazyfs import nativeblobs, sysmount
from lazyfs.blob import LayerBlob
from lazyfs.tree import LayerTree
from tests.helpers.lazynode import REPO, LazyNode
from tests.helpers.support import flip_byte, pack_path, wait_until
from tests.helpers.treediff import diff_trees
from tests.test_kernel_path import _kernel_path_missing, _workload, image, image_tars

__all__ = ["image", "image_tars"]  # (fixtures, used by name)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(_kernel_path_missing() is not None,
                                 reason=str(_kernel_path_missing()))]

BIG = "posix/sizes/random_3mib"


def _server_pids() -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.path.basename(os.readlink(f"/proc/{d}/exe")).startswith("lazyfs-blobd"):
                    out.add(int(d))
            except OSError:
                continue
    return out


def _native(node: LazyNode) -> dict[str, Any]:
    native: dict[str, Any] = node.stats()["native"]
    return native


@pytest.fixture
def node(tmp_path: Path, store: ChunkStore) -> Iterator[LazyNode]:
    with LazyNode(tmp_path / "node", Path(store.root), extra=["--native-blobs"]) as n:
        yield n


def _trace_keys(node: LazyNode, mount: Path) -> set[tuple[str, str, int]]:
    events = node.request({"op": "trace", "mount": str(mount)})["trace"]["events"]
    return {(e["layer"], e["path"], e["chunk"]) for e in events}


def test_reads_are_served_natively_and_counted_as_the_python_path_counts_them(
        tmp_path: Path, store: ChunkStore, cat: Catalog, image: list[str],
        image_tars: dict[str, Path]) -> None:
    got = {}
    for native in (True, False):
        flag = "--native-blobs" if native else "--no-native-blobs"
        with LazyNode(tmp_path / f"node-{native}", Path(store.root), extra=[flag]) as n:
            root = n.mount(cat, "posix:1", tmp_path / f"root-{native}", kernel=True)
            _workload(root)
            stats = n.stats()
            rows = {r["layer"]: r for r in stats["mounts"] if r["mount"] == str(root)}
            got[native] = (
                {d: (r["files_touched"], r["chunks_touched"], r["touched_bytes"])
                 for d, r in rows.items()},
                _trace_keys(n, root),
                stats["cache"]["fetched_bytes"])
            if native:
                assert stats["native"]["pid"] in _server_pids()
                assert stats["native"]["reports"] > 0
                assert diff_trees(image_tars["ref"], root) == []  # every byte, natively
            else:
                assert "native" not in stats
    assert got[True][0] == got[False][0]  # the read ledger of the mount
    assert got[True][1] == got[False][1]  # its trace
    assert got[True][1]
    # bytes fetched from the store: what was read (the Python path's blob
    # readahead may fetch a chunk more)
    assert 0 < got[True][2] <= got[False][2]


def test_a_peer_that_is_not_the_server_is_not_heard(node: LazyNode, cat: Catalog,
                                                    image: list[str], tmp_path: Path) -> None:
    root = node.mount(cat, "posix:1", tmp_path / "root", kernel=True)
    (root / "etc" / "motd").read_bytes()
    before = node.stats()["layers"]
    # a forged report of the whole blob of layer 0, and a fetch request
    forged = struct.pack("<4sIQIIHHHHQQQ", b"R\0\0\0", 0, 0, 1 << 30, os.getpid(),
                         0, 0, 64, 0, 1 << 30, 0, 1).ljust(64, b"\0")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(str(node.paths.native_socket))
    try:
        s.send(forged)
        s.send(struct.pack("<4sII", b"F\0\0\0", 0, 0).ljust(64, b"\0"))
        assert s.recv(64) == b""  # closed, unanswered
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        s.close()
    assert node.stats()["layers"] == before
    assert "refused (not the server)" in node.log()


def test_a_server_killed_mid_read_is_replaced_on_its_connection_readers_never_see_it(
        node: LazyNode, cat: Catalog, image: list[str], image_tars: dict[str, Path],
        tmp_path: Path) -> None:
    """SIGKILL of lazyfs-blobd while 4 readers stream the image with the page
    cache dropped: the daemon holds the FUSE connection, the next server
    takes it over and the kernel sends it again what the dead one had
    taken. Every read returns the right bytes (none fails, none is wrong),
    and the root mounted before the kill reads the whole image after it."""
    ref = image_tars["ref"]
    files = sorted(str(p.relative_to(ref)) for p in ref.rglob("*")
                   if p.is_file() and not p.is_symlink() and p.stat().st_size > 4096)
    old = node.mount(cat, "posix:1", tmp_path / "old", kernel=True)
    pid = _native(node)["pid"]
    wrong: list[str] = []
    errors: list[str] = []
    reads = [0]
    stop = threading.Event()

    def reader(k: int) -> None:
        rng = random.Random(k)
        while not stop.is_set():
            rel = rng.choice(files)
            try:
                data = (old / rel).read_bytes()
            except OSError as e:
                errors.append(f"{rel}: {e}")
                continue
            reads[0] += 1
            if data != (ref / rel).read_bytes():
                wrong.append(rel)
            subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    node.request({"op": "drop_cache"})
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
    for t in threads:
        t.start()
    time.sleep(1.0)
    before = reads[0]
    os.kill(pid, signal.SIGKILL)
    new_pid = wait_until(lambda: (n := _native(node)["pid"]) not in (None, pid) and n,
                         30, "a new server")
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(60)
    assert wrong == [] and errors == [], (wrong[:5], errors[:5])
    assert reads[0] > before, "no read finished after the kill"
    assert _native(node)["restarts"] == 1 and pid not in _server_pids()
    # the root mounted before the kill reads everything through the new server
    node.request({"op": "drop_cache"})
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
    assert diff_trees(ref, old) == []
    new = node.mount(cat, "posix:1", tmp_path / "new", kernel=True)
    assert diff_trees(ref, new) == []
    assert _native(node)["pid"] == new_pid


def test_a_corrupt_node_cache_chunk_is_fetched_again_and_a_corrupt_pack_is_eio(
        tmp_path: Path, store: ChunkStore, cat: Catalog, image: list[str],
        image_tars: dict[str, Path]) -> None:
    """A node with no local store: chunks come from the cluster (a shared
    POSIX directory) through the daemon into the node cache, and from the
    cache natively after that."""
    shared = tmp_path / "shared"
    shared.mkdir()
    url = f"posix://{shared}"
    with Cluster(open_object_store(url)) as cluster:
        push(cluster, store, cat, "posix:1")
    want = (image_tars["ref"] / BIG).read_bytes()
    with LazyNode(tmp_path / "node", tmp_path / "none", cluster=url,
                  extra=["--native-blobs"]) as node, \
            Cluster(open_object_store(url)) as cluster:
        root = node.mount(ClusterCatalog(cluster), "posix:1", tmp_path / "root", kernel=True)
        assert (root / BIG).read_bytes() == want
        assert node.stats()["cache"]["fetched_bytes"] >= len(want)
        # every cached chunk of the file, one byte flipped; a server that
        # forgot its memory (killed: the daemon starts another)
        m = cat.load_layer(image[0])
        entry = next(e for e in m.entries if e.path == BIG)
        dom = next(p for p in (node.cache).iterdir() if p.name.startswith("dom-"))
        flipped = 0
        for ref in entry.chunks:
            assert ref.id is not None
            f = dom / str(ref.id)[:2] / str(ref.id)
            wait_until(f.exists, 10, f"chunk {ref.id} in the node cache")
            flip_byte(f, 100)
            flipped += 1
        old = _native(node)["pid"]
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: _native(node)["pid"] not in (None, old), 30, "a new server")
        fresh = node.mount(ClusterCatalog(cluster), "posix:1", tmp_path / "fresh", kernel=True)
        subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
        assert (fresh / BIG).read_bytes() == want
        st = node.stats()
        assert st["native"]["cache_corrupt"] >= flipped
        assert st["cache"]["corrupt_dropped"] >= flipped
    # the store itself corrupt: EIO, never the bytes
    ids = sorted(c.id for c in entry.chunks if c.id is not None)
    info = store.stat(ids[0])
    flip_byte(pack_path(Path(store.root), info.pack), info.offset + 5)
    with LazyNode(tmp_path / "node2", Path(store.root), extra=["--native-blobs"]) as node:
        root = node.mount(cat, "posix:1", tmp_path / "root2", kernel=True)
        start = next(c.offset for c in _offsets(entry) if c.id == ids[0])
        with open(root / BIG, "rb") as fh:
            fh.seek(start)
            with pytest.raises(OSError) as e:
                fh.read(4096)
        assert e.value.errno == errno.EIO
        assert node.stats()["native"]["pack_corrupt"] >= 1
        assert BIG in node.log()


class _At:
    def __init__(self, cid: Any, offset: int) -> None:
        self.id, self.offset = cid, offset


def _offsets(entry: Any) -> list[_At]:
    out, pos = [], 0
    for ref in entry.chunks:
        out.append(_At(ref.id, pos))
        pos += ref.length
    return out


def test_the_daemon_stopping_or_dying_takes_the_server_and_its_mount_along(
        tmp_path: Path, store: ChunkStore, cat: Catalog, image: list[str]) -> None:
    for how in ("stop", "kill"):
        node = LazyNode(tmp_path / f"node-{how}", Path(store.root), extra=["--native-blobs"])
        node.start()
        try:
            root = node.mount(cat, "posix:1", tmp_path / f"root-{how}", kernel=True)
            (root / BIG).read_bytes()
            pid = _native(node)["pid"]
            if how == "kill":
                node.kill()  # SIGKILL: the server's parent-death signal
                gone = pid
                wait_until(lambda: gone not in _server_pids(), 20, "the server to exit")  # noqa: B023
        finally:
            node.close()
        assert pid not in _server_pids()
        paths = node.paths
        assert sysmount.find_mount(paths.native_blobs) is None
        left = [m.mount_point for m in sysmount.mounts()
                if m.mount_point.startswith(str(paths.root))]
        assert left == []
        if how == "stop":
            assert not paths.native_socket.exists() and not paths.native_tables.exists()


def _table(store: ChunkStore, cat: Catalog, digest: str) -> bytes:
    tree = LayerTree.build(digest, cat.load_layer(digest), 100)
    data, _, _, _ = nativeblobs.table_bytes(7, LayerBlob.build(tree), "/var/empty/cache", store)
    return data


def test_malformed_extent_tables_are_refused_in_one_line(store: ChunkStore, cat: Catalog,
                                                         image: list[str],
                                                         tmp_path: Path) -> None:
    """The server's table parser against a real table and 400 mutations of
    it, built with ASan + UBSan: each one accepted or refused with a line,
    never a crash or a sanitizer finding."""
    server = nativeblobs.binary(sanitize=True)
    good = _table(store, cat, image[0])
    path = tmp_path / "t.ext"
    path.write_bytes(good)
    ok, said = nativeblobs.check_table(path, server=server)
    assert ok, said
    n_chunks, n_segs = struct.unpack_from("<II", good, 24)
    assert f"{n_chunks} chunks, {n_segs} segments" in said
    rng = random.Random(35)
    refused = 0
    for i in range(400):
        bad = bytearray(good)
        how = i % 4
        if how == 0:  # bytes flipped anywhere
            for _ in range(rng.randint(1, 8)):
                bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        elif how == 1:  # a header field set to an extreme
            off = rng.choice([12, 16, 20, 24, 28, 32, 34])
            width = 8 if off in (16,) else 2 if off in (32, 34) else 4
            bad[off:off + width] = rng.choice([b"\xff", b"\x00", b"\x7f"]) * width
        elif how == 2:  # cut short, or grown
            bad = bad[:rng.randrange(len(bad))] if rng.random() < 0.7 else \
                bad + os.urandom(rng.randint(1, 100))
        else:  # a segment's fields
            seg0 = len(good) - n_segs * 24
            k = seg0 + 24 * rng.randrange(n_segs) + rng.choice([0, 8, 12, 16])
            bad[k:k + 4] = struct.pack("<I", rng.choice([0, 1 << 31, 0xFFFFFFFF,
                                                         rng.randrange(1 << 32)]))
        path.write_bytes(bytes(bad))
        p = subprocess.run([str(server), "--check", str(path)], capture_output=True,
                           text=True, timeout=60, check=False)
        out = p.stdout + p.stderr
        assert p.returncode in (0, 1), (i, p.returncode, out[-2000:])
        assert "Sanitizer" not in out and "runtime error" not in out, (i, out[-2000:])
        if p.returncode == 1:
            refused += 1
            assert out.startswith("lazyfs-blobd: ") and out.count("\n") <= 1, out
    assert refused > 300
    for cut, why in ((10, "shorter than a header"), (len(good) - 1, "run past the end")):
        path.write_bytes(good[:cut])
        ok, said = nativeblobs.check_table(path, server=server)
        assert not ok and why in said, said


def test_the_server_under_address_and_undefined_behaviour_sanitizers(
        tmp_path: Path, store: ChunkStore, cat: Catalog, image: list[str],
        image_tars: dict[str, Path]) -> None:
    """The suite's run of the server built with -fsanitize=address,undefined:
    concurrent cold reads of the whole image, a drop of its hot set, a
    corrupt chunk, a server killed and one taking its connection over; any
    finding ends the server (and would show as a restart and in the log)."""
    m = cat.load_layer(image[0])
    entry = next(e for e in m.entries if e.path == BIG)
    last = entry.chunks[-1].id
    assert last is not None
    info = store.stat(last)
    flip_byte(pack_path(Path(store.root), info.pack), info.offset + info.stored_len - 3)
    ref = image_tars["ref"]
    with LazyNode(tmp_path / "node", Path(store.root),
                  extra=["--native-blobs", "--native-sanitize"]) as node:
        pid = _native(node)["pid"]
        assert os.readlink(f"/proc/{pid}/exe").endswith("-asan")
        roots = [node.mount(cat, "posix:1", tmp_path / f"root{k}", kernel=True)
                 for k in range(2)]
        node.request({"op": "drop_cache"})
        subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
        diffs: list[Any] = []

        def reader(k: int) -> None:
            diffs.extend(d for d in diff_trees(ref, roots[k % 2]) if BIG not in str(d))

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert diffs == []
        with open(roots[0] / BIG, "rb") as fh:
            fh.seek(entry.size - 1000)
            with pytest.raises(OSError) as e:
                fh.read(1000)
        assert e.value.errno == errno.EIO
        native = _native(node)
        assert native["pid"] == pid and native["restarts"] == 0
        # a server taking over a dead one's connection (resume: an INIT of
        # its own, the kernel's resend, layers found by their tables), checked too
        os.kill(pid, signal.SIGKILL)
        new = wait_until(lambda: (n := _native(node)["pid"]) not in (None, pid) and n,
                         30, "a new server")
        assert os.readlink(f"/proc/{new}/exe").endswith("-asan")
        node.request({"op": "drop_cache"})
        subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
        assert [d for d in diff_trees(ref, roots[1]) if BIG not in str(d)] == []
        assert _native(node)["restarts"] == 1 and _native(node)["pid"] == new
    log = node.log()
    assert "Sanitizer" not in log and "runtime error" not in log, log[-3000:]


def test_a_walk_through_a_cluster_image_fetches_ahead_and_a_sparse_reader_only_what_it_reads(
        tmp_path: Path, store: ChunkStore, cat: Catalog, image: list[str],
        image_tars: dict[str, Path]) -> None:
    """On a node reading from a cluster store (a shared POSIX directory),
    a reader walking a directory's files in order gets the next files
    fetched ahead; one reading a few files here and there fetches exactly
    those."""
    shared = tmp_path / "shared"
    shared.mkdir()
    url = f"posix://{shared}"
    with Cluster(open_object_store(url)) as cluster:
        push(cluster, store, cat, "posix:1")
    ref = image_tars["ref"]
    m = cat.load_layer(image[0])
    sizes = {e.path: e.size for e in m.entries if e.chunks}
    big = sorted(p for p in sizes if p.startswith("posix/big/") and p != "posix/big/f00007")
    assert len(big) > 40
    with LazyNode(tmp_path / "sparse", tmp_path / "none", cluster=url,
                  extra=["--native-blobs"]) as node, \
            Cluster(open_object_store(url)) as cluster:
        root = node.mount(ClusterCatalog(cluster), "posix:1", tmp_path / "r1", kernel=True)
        picked = big[::9]
        for p in picked:
            assert (root / p).read_bytes() == (ref / p).read_bytes()
        st = node.stats()
        assert st["prefetched_chunks"] == 0
        assert st["cache"]["fetched_bytes"] == sum(sizes[p] for p in picked)
    with LazyNode(tmp_path / "walk", tmp_path / "none", cluster=url,
                  extra=["--native-blobs"]) as node, \
            Cluster(open_object_store(url)) as cluster:
        root = node.mount(ClusterCatalog(cluster), "posix:1", tmp_path / "r2", kernel=True)
        for p in big:
            assert (root / p).read_bytes() == (ref / p).read_bytes()
        st = node.stats()
        assert st["prefetched_chunks"] > len(big) // 2
        # ahead of the walk, never past the layer
        assert st["cache"]["fetched_bytes"] <= sum(sizes.values())


@pytest.mark.parametrize("what", ["daemon", "daemon and server"])
def test_killing_the_daemon_under_40_readers_errors_or_right_bytes_then_the_node_recovers(
        what: str, tmp_path: Path, store: ChunkStore, cat: Catalog, image: list[str],
        image_tars: dict[str, Path]) -> None:
    """SIGKILL of the lazyfs daemon (or of its native server, then the
    daemon) while 40 readers stream the image's larger files with the page
    cache dropped: every read ends with the right bytes or an error, never
    wrong ones; no read waits past the fetch timeout; after it, `lazyfs
    umount ROOT/mnt` leaves nothing mounted and a new daemon on the same
    root serves a new mount of the whole image."""
    ref = image_tars["ref"]
    files = sorted(str(p.relative_to(ref)) for p in ref.rglob("*")
                   if p.is_file() and not p.is_symlink() and p.stat().st_size >= 64 << 10)
    want = {rel: (ref / rel).read_bytes() for rel in files}
    node = LazyNode(tmp_path / "node", Path(store.root), extra=["--native-blobs"])
    node.start()
    try:
        root = node.mount(cat, "posix:1", tmp_path / "root", kernel=True)
        server = _native(node)["pid"]
        done: list[str] = []
        wrong: list[str] = []
        errors_after: list[str] = []
        slowest = [0.0]
        killed = threading.Event()
        stop = threading.Event()

        def reader(k: int) -> None:
            rng = random.Random(k)
            while not stop.is_set():
                rel = rng.choice(files)
                got = bytearray()
                try:
                    with open(root / rel, "rb") as f:
                        while True:
                            t = time.monotonic()
                            piece = f.read(128 << 10)
                            slowest[0] = max(slowest[0], time.monotonic() - t)
                            if not piece:
                                break
                            got += piece
                except OSError as e:
                    if killed.is_set():
                        errors_after.append(f"{rel}: {e.strerror}")
                    else:
                        wrong.append(f"{rel}: failed before the kill: {e}")
                    continue
                if bytes(got) != want[rel]:
                    wrong.append(rel)
                done.append(rel)

        node.request({"op": "drop_cache"})
        subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
        threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(40)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        if what != "daemon":
            os.kill(server, signal.SIGKILL)
        killed.set()
        node.kill()
        subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(45)
        assert not [t for t in threads if t.is_alive()], "a reader hangs"
        assert wrong == [], wrong[:5]
        assert done and errors_after, (len(done), len(errors_after))
        assert slowest[0] < 30 + 10, slowest  # (the fetch timeout, and then some)
        wait_until(lambda: server not in _server_pids(), 20, "the server to exit")
        # the node recovers: umount ROOT/mnt cleans up, a new daemon serves a new mount
        p = subprocess.run([sys.executable, "-m", "tools.cli", "umount", "--lazy",
                            str(node.paths.mnt)], cwd=REPO, capture_output=True, text=True,
                           timeout=120, check=False)
        assert p.returncode == 0, p.stderr
        node.mounted.clear()
        assert [m.mount_point for m in sysmount.mounts()
                if m.mount_point.startswith(str(node.paths.root) + "/")
                or m.mount_point == str(tmp_path / "root")] == []
    finally:
        node.close()
    again = LazyNode(tmp_path / "node", Path(store.root), extra=["--native-blobs"])
    with again:
        new = again.mount(cat, "posix:1", tmp_path / "again", kernel=True)
        assert diff_trees(ref, new) == []
