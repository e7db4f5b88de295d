"""The kernel path for composed roots: overlayfs over the layers' shared
kernel EROFS mounts (metadata image on the node, data from the daemon's
blob), against the same image on the FUSE tree path and extracted.

Real mounts (root, /dev/fuse, EROFS in the kernel); every mount is taken
down in finalizers (LazyNode.close releases the shared EROFS mounts too)."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstore import ChunkStore
from composer.catalog import Catalog
from composer.convert import convert
from lazyfs import erofsmounts, sysmount
from lazyfs.mounts import KERNEL_DEFAULT, MountError, mount_image, registered, unmount
from lazyfs.node import NodePaths
from tests.helpers.images import (
    add_special_files,
    build_busybox_rootfs,
    chroot_run,
    extract_layers,
    tar_of,
    whiteout_layer,
)
from tests.helpers.lazynode import REPO, LazyNode, fuse_missing
from tests.helpers.support import flip_byte, pack_path, wait_until
from tests.helpers.treediff import diff_trees
from tests.test_lazyfs import make_image

MIB = 1 << 20


def _kernel_path_missing() -> str | None:
    if (why := fuse_missing()) is not None:
        return why
    if not erofsmounts.available():
        return "this kernel has no EROFS (CONFIG_EROFS_FS)"
    return None


pytestmark = [pytest.mark.root,
              pytest.mark.skipif(_kernel_path_missing() is not None,
                                 reason=str(_kernel_path_missing()))]


@pytest.fixture(scope="module")
def image_tars(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tricky image of the lazyfs tests: devices, hardlinks, xattrs,
    sparse files, a 10,000-entry directory, 255-byte names, a 40-deep path,
    and an upper layer with whiteouts and an opaque directory."""
    d = tmp_path_factory.mktemp("kernelimg")
    base = build_busybox_rootfs(d / "base")
    add_special_files(base)
    upper = whiteout_layer(d / "upper", remove=["etc/hostname", "posix/big/f00007"],
                           opaque=["posix/deep"], add={"posix/deep/new": b"new\n",
                                                       "etc/motd": b"hello\n"}, like=base)
    tars = {"base": tar_of(base, d / "base.tar"), "upper": tar_of(upper, d / "upper.tar")}
    tars["ref"] = extract_layers([tars["base"], tars["upper"]], d / "ref")
    return tars


@pytest.fixture
def image(store: ChunkStore, cat: Catalog, image_tars: dict[str, Path]) -> list[str]:
    return make_image(store, cat, "posix:1", [image_tars["base"], image_tars["upper"]])


@pytest.fixture
def node(tmp_path: Path, store: ChunkStore) -> Iterator[LazyNode]:
    with LazyNode(tmp_path / "node", Path(store.root)) as n:
        yield n


def _erofs_by_layer(node: LazyNode) -> dict[str, int]:
    """How many EROFS mounts in this namespace have each layer's meta image
    as their source (the shared ones and any duplicate)."""
    counts: dict[str, int] = {}
    images = os.path.realpath(node.paths.erofs_images)
    for m in sysmount.mounts():
        if m.fstype == "erofs" and os.path.dirname(m.source) == images:
            digest = os.path.basename(m.source).removesuffix(".meta.erofs")
            counts[digest] = counts.get(digest, 0) + 1
    return counts


def _lowerdirs(mountpoint: Path) -> str:
    info = sysmount.find_mount(mountpoint)
    assert info is not None and info.fstype == "overlay"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split()[4] == str(mountpoint):
                return right.split()[2]
    raise AssertionError(f"{mountpoint} not in mountinfo")


def test_the_kernel_path_is_the_default() -> None:
    assert KERNEL_DEFAULT is True


def test_composed_root_equals_the_extracted_image(node: LazyNode, cat: Catalog,
                                                  image: list[str], image_tars: dict[str, Path],
                                                  tmp_path: Path) -> None:
    ro = node.mount(cat, "posix:1", tmp_path / "ro", kernel=True)
    rw = node.mount(cat, "posix:1", tmp_path / "rw", writable=tmp_path / "w", kernel=True)
    for mp in (ro, rw):
        assert str(node.paths.erofs_mounts) in _lowerdirs(mp)
        assert "/mnt/layers/" not in _lowerdirs(mp)
    regs = {r["mountpoint"]: r for r in registered(node.paths)}
    assert regs[str(ro)]["lowers"] == "kernel" and regs[str(ro)]["erofs_layers"] == image
    # metadata work is in the kernel: the walk fetched no data
    subprocess.run(["ls", "-lR", str(ro)], check=True, capture_output=True)
    assert node.stats()["cache"]["misses"] == 0, "a metadata walk fetched data"
    assert diff_trees(image_tars["ref"], ro) == []
    assert diff_trees(image_tars["ref"], rw) == []
    # whiteouts and the opaque dir applied; writes stay in the upper
    assert not (ro / "etc" / "hostname").exists() and (ro / "etc" / "motd").read_text() == "hello\n"
    assert os.listdir(ro / "posix" / "deep") == ["new"]
    (rw / "etc" / "motd").write_text("changed\n")
    assert (tmp_path / "w" / "upper" / "etc" / "motd").read_text() == "changed\n"
    assert (ro / "etc" / "motd").read_text() == "hello\n"
    with pytest.raises(OSError) as e:
        (ro / "etc" / "new").write_text("x")
    assert e.value.errno == errno.EROFS
    # the image's setuid binaries and devices do nothing on the host by default
    for mp in (ro, rw):
        flags = os.statvfs(mp).f_flag
        assert flags & os.ST_NOSUID and flags & os.ST_NODEV
    # programs run from it
    assert chroot_run(rw, "/bin/busybox", "cat", "/etc/motd").stdout == "changed\n"


def test_two_roots_share_one_erofs_mount_per_layer(node: LazyNode, cat: Catalog,
                                                   image: list[str], tmp_path: Path) -> None:
    a = node.mount(cat, "posix:1", tmp_path / "a", kernel=True)
    b = node.mount(cat, "posix:1", tmp_path / "b", writable=tmp_path / "wb", kernel=True)
    assert _erofs_by_layer(node) == {d: 1 for d in image}
    # one superblock: both roots see the layer's inode numbers through one mount
    shared = {Path(m.mount_point).name: m for m in node.erofs_mounts()}
    assert set(shared) == set(image)
    for m in shared.values():
        flags = os.statvfs(m.mount_point).f_flag
        assert flags & os.ST_RDONLY and flags & os.ST_NOSUID and flags & os.ST_NODEV
    assert (a / "bin" / "busybox").read_bytes() == (b / "bin" / "busybox").read_bytes()
    node.unmount(a)
    assert _erofs_by_layer(node) == {d: 1 for d in image}, "released while b uses it"
    assert (b / "etc" / "passwd").read_bytes().startswith(b"root:")
    node.unmount(b)
    assert _erofs_by_layer(node) == {}, "the last unmount must release the layer mounts"
    assert not any(node.paths.erofs_mounts.iterdir())
    # the meta images stay cached on the node for the next mount
    assert sorted(p.name for p in node.paths.erofs_images.iterdir()) == \
        sorted(f"{d}.meta.erofs" for d in image)


def test_the_count_comes_from_the_registry_and_survives_a_crash(
        node: LazyNode, cat: Catalog, image: list[str], tmp_path: Path) -> None:
    a = node.mount(cat, "posix:1", tmp_path / "a", kernel=True)
    b = node.mount(cat, "posix:1", tmp_path / "b", kernel=True)
    # a user that crashed: its root unmounted without `unmount`, registry left
    sysmount.umount(a)
    node.mounted.remove(a)
    assert any(r["mountpoint"] == str(a) for r in registered(node.paths))
    node.unmount(b)  # b was the last root still mounted: everything goes
    assert _erofs_by_layer(node) == {}
    # an EROFS mount nobody registered (a mounter killed between the two) is
    # released by the next bookkeeping pass, here the daemon's stop command
    c = node.mount(cat, "posix:1", tmp_path / "c", kernel=True)
    sysmount.umount(c)
    node.mounted.remove(c)
    (node.paths.mounts / "stale.json").write_text(json.dumps(
        {"mountpoint": str(tmp_path / "nowhere"), "erofs_layers": image}))
    assert _erofs_by_layer(node) == {d: 1 for d in image}
    p = subprocess.run([sys.executable, "-m", "tools.cli", "--store", str(node.store), "umount",
                        str(node.mnt), "--root", str(node.paths.root)],
                       capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert _erofs_by_layer(node) == {} and sysmount.find_mount(node.mnt) is None


def test_concurrent_mounts_and_unmounts_keep_the_count(node: LazyNode, cat: Catalog,
                                                       image: list[str], tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for n in range(6):
                mp = tmp_path / f"m{k}-{n}"
                mp.mkdir()
                mount_image(node.paths, cat, "posix:1", mp, kernel=True)
                try:
                    assert (mp / "etc" / "motd").read_text() == "hello\n"
                finally:
                    unmount(node.paths, mp)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
    keep = node.mount(cat, "posix:1", tmp_path / "keep", kernel=True)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert _erofs_by_layer(node) == {d: 1 for d in image}
    assert (keep / "etc" / "motd").read_text() == "hello\n"
    node.unmount(keep)
    assert _erofs_by_layer(node) == {}


_MOUNTER = """
import sys
from pathlib import Path
from chunkstore import ChunkStore
from lazyfs.mounts import mount_image, unmount
from lazyfs.node import NodePaths, store_catalog
op, store, root, mp = sys.argv[1:]
paths = NodePaths(Path(root))
if op == "mount":
    with ChunkStore.open(Path(store)) as s, store_catalog(s) as cat:
        mount_image(paths, cat, "posix:1", Path(mp), kernel=True)
else:
    unmount(paths, Path(mp))
"""


def _in_another_process(op: str, node: LazyNode, mp: Path) -> None:
    p = subprocess.run([sys.executable, "-c", _MOUNTER, op, str(node.store),
                        str(node.paths.root), str(mp)],
                       capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert p.returncode == 0, p.stderr


def _users(node: LazyNode) -> dict[str, set[str]]:
    """The layers' user index (ROOT/erofs-refs): layer -> mount points."""
    refs = node.paths.erofs_refs
    return {d.name: {os.readlink(link) for link in d.iterdir()}
            for d in (refs.iterdir() if refs.is_dir() else []) if d.is_dir()}


def test_layer_users_are_counted_across_processes(node: LazyNode, cat: Catalog,
                                                  image: list[str], tmp_path: Path) -> None:
    """Two processes share a node root: a root mounted by another process
    keeps the shared layer mounts while this one unmounts its own, and the
    other's unmount takes them down once nothing uses them; the per-layer
    user index says the same as the registry at every step."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    _in_another_process("mount", node, a)
    node.mount(cat, "posix:1", b, writable=tmp_path / "wb", kernel=True)
    assert _erofs_by_layer(node) == {d: 1 for d in image}, "one shared mount per layer"
    assert _users(node) == {d: {str(a), str(b)} for d in image}
    node.unmount(b)
    assert _erofs_by_layer(node) == {d: 1 for d in image}, "released while a uses it"
    assert _users(node) == {d: {str(a)} for d in image}
    assert (a / "etc" / "motd").read_text() == "hello\n"
    # the index lost (a node root from before it existed): the next release
    # rebuilds it from the registry instead of taking a's layers down
    node.mount(cat, "posix:1", b, kernel=True)
    for d in image:
        (node.paths.erofs_refs / d / erofsmounts.user_key(a)).unlink()
    (node.paths.erofs_refs / ".complete").unlink()
    node.unmount(b)
    assert _erofs_by_layer(node) == {d: 1 for d in image}
    assert _users(node) == {d: {str(a)} for d in image}
    _in_another_process("unmount", node, a)
    assert _erofs_by_layer(node) == {}, "the last unmount must release the layer mounts"
    assert _users(node) == {} and not any(node.paths.erofs_mounts.iterdir())
    assert not registered(node.paths)


def _workload(root: Path) -> None:
    subprocess.run(["ls", "-lR", str(root)], check=True, capture_output=True)
    for name in ("posix/sizes/random_3mib", "posix/links/two", "etc/motd"):
        (root / name).read_bytes()
    assert chroot_run(root, "/bin/busybox", "cat", "/etc/passwd").returncode == 0


def test_touched_figures_match_the_fuse_path(tmp_path: Path, store: ChunkStore, cat: Catalog,
                                             image: list[str]) -> None:
    figures = {}
    for kernel in (False, True):
        with LazyNode(tmp_path / f"node-{kernel}", Path(store.root)) as n:
            root = n.mount(cat, "posix:1", tmp_path / f"root-{kernel}", kernel=kernel)
            _workload(root)
            figures[kernel] = n.stats()["layers"]
            cli = subprocess.run([sys.executable, "-m", "tools.cli", "--store", str(store.root),
                                  "stats", "--root", str(n.paths.root)], capture_output=True,
                                 text=True, cwd=REPO, timeout=60, check=True).stdout
            assert "posix:1: touched" in cli
    fuse, kern = figures[False], figures[True]
    for d in image:
        f, k = fuse.get(d, {}), kern.get(d, {})
        assert f.get("files_touched", 0) == k.get("files_touched", 0), (d, f, k)
        assert f.get("image_bytes") == k.get("image_bytes")
        tf, tk = f.get("touched_bytes", 0), k.get("touched_bytes", 0)
        assert abs(tf - tk) <= 0.05 * max(tf, tk), (d, tf, tk)
    assert kern[image[0]]["touched_fraction"] > 0


def _mount_row(stats: dict[str, Any], mount: Path) -> dict[str, Any]:
    rows = [r for r in stats["mounts"] if r["mount"] == str(mount)]
    return {"files_touched": sum(r["files_touched"] for r in rows),
            "touched_bytes": sum(r["touched_bytes"] for r in rows)}


def test_each_root_has_its_own_reads_on_the_kernel_path(node: LazyNode, cat: Catalog,
                                                         image: list[str],
                                                         image_tars: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """Two roots of one image on the kernel path (one shared EROFS mount per
    layer): each root's files, touched bytes and trace are its own, also
    when the reader sees the root from another mount namespace (as a
    container does), and a loop of opens costs the daemon one event."""
    a = node.mount(cat, "posix:1", tmp_path / "a", kernel=True)
    b = node.mount(cat, "posix:1", tmp_path / "b", kernel=True)
    big = len((image_tars["ref"] / "posix/sizes/random_3mib").read_bytes())
    assert chroot_run(a, "/bin/busybox", "wc", "-c", "/posix/sizes/random_3mib").stdout.split()[0] \
        == str(big)
    assert chroot_run(b, "/bin/busybox", "cat", "/etc/motd").stdout == "hello\n"
    # b seen from a mount namespace of its own, under another path (a container's view)
    view = tmp_path / "view"
    view.mkdir()
    script = f'mount --bind "{b}" "{view}" && chroot "{view}" /bin/busybox cat /posix/links/two'
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=30, check=False)
    assert p.returncode == 0, p.stderr
    st = node.stats()
    ra, rb = _mount_row(st, a), _mount_row(st, b)
    assert ra["touched_bytes"] >= big, st["mounts"]  # its chunks, and busybox's
    assert ra["files_touched"] >= 2 and rb["files_touched"] >= 3, st["mounts"]
    assert rb["touched_bytes"] < big  # busybox came from the page cache a's reads filled
    assert _mount_row(st, Path("")) == {"files_touched": 0, "touched_bytes": 0}, st["mounts"]

    def paths(mount: Path) -> set[str]:
        events = node.request({"op": "trace", "mount": str(mount)})["trace"]["events"]
        return {e["path"] for e in events}
    links = {"posix/links/one", "posix/links/two", "posix/elsewhere/three"}  # one inode
    assert "posix/sizes/random_3mib" in paths(a) and "bin/busybox" in paths(a)
    assert "etc/motd" in paths(b) and paths(b) & links
    assert not paths(a) & ({"etc/motd"} | links)
    assert "posix/sizes/random_3mib" not in paths(b)

    # a file opened again gets an ignore mark: 20,000 more opens of it never
    # reach the daemon
    def events() -> int:
        return int(node.stats()["open_watches"][str(a)]["events"])
    for _ in range(2):  # one at a time: the kernel merges a queued event's repeats
        before = events()
        os.close(os.open(a / "etc/motd", os.O_RDONLY))
        wait_until(lambda b=before: events() > b, 10, "an open as an event")  # type: ignore[misc]
    before = events()
    for _ in range(20_000):
        os.close(os.open(a / "etc/motd", os.O_RDONLY))
    after = node.stats()["open_watches"][str(a)]
    assert after["state"] == "watching" and after["events"] == before, after
    # unmounted right after its reads: nothing the daemon holds keeps it busy
    node.unmount(a)
    assert str(a) not in node.stats()["open_watches"]
    node.unmount(b)


def test_concurrent_cold_reads_give_the_source_bytes(node: LazyNode, cat: Catalog,
                                                     image: list[str],
                                                     image_tars: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """Readers at once through the default path, page cache and node cache
    dropped, the big files read by every reader: each file reads exactly as
    in the extracted image (small fetches run on the daemon's event loop,
    big ones in worker threads, one fetch per chunk between them), and no
    chunk read from the local store was copied into the node cache."""
    root = node.mount(cat, "posix:1", tmp_path / "ro", kernel=True)
    ref = image_tars["ref"]
    files = sorted(str(p.relative_to(ref)) for p in ref.rglob("*")
                   if p.is_file() and not p.is_symlink())
    big = [f for f in files if (ref / f).stat().st_size > 256 << 10]
    assert big
    node.request({"op": "drop_cache"})
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
    wrong: list[str] = []

    def reader(k: int) -> None:
        rng = random.Random(k)
        for rel in rng.sample(files, min(300, len(files))) + rng.sample(big, len(big)):
            if (root / rel).read_bytes() != (ref / rel).read_bytes():
                wrong.append(rel)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    st = node.stats()
    assert st["errors"] == 0 and st["cache"]["chunks"] == 0
    assert st["cache"]["fetched_bytes"] > 0  # they came through the daemon


def test_corrupt_blob_chunk_is_eio_through_the_composed_root(
        tmp_path: Path, store: ChunkStore, cat: Catalog, image: list[str]) -> None:
    m = cat.load_layer(image[0])
    entry = next(e for e in m.entries if e.path == "posix/sizes/random_3mib")
    cid = entry.chunks[-1].id
    assert cid is not None
    info = store.stat(cid)
    flip_byte(pack_path(Path(store.root), info.pack), info.offset + info.stored_len - 3)
    with LazyNode(tmp_path / "node", Path(store.root)) as node:
        root = node.mount(cat, "posix:1", tmp_path / "root", kernel=True)
        with open(root / "posix" / "sizes" / "random_3mib", "rb") as fh:
            assert len(fh.read(4096)) == 4096  # chunk 0 is fine
            fh.seek(entry.size - 4096)
            with pytest.raises(OSError) as e:
                fh.read(4096)
        assert e.value.errno == errno.EIO
        assert node.stats()["errors"] >= 1
        assert str(cid) in node.log() and "posix/sizes/random_3mib" in node.log()


def test_a_killed_daemon_gives_errors_and_cleanup_unmounts_everything(
        tmp_path: Path, store: ChunkStore, cat: Catalog, image: list[str]) -> None:
    node = LazyNode(tmp_path / "node", Path(store.root))
    node.start()
    cli = [sys.executable, "-m", "tools.cli", "--store", str(store.root)]
    try:
        old = node.mount(cat, "posix:1", tmp_path / "old", kernel=True)
        assert (old / "etc" / "passwd").read_bytes().startswith(b"root:")
        node.kill()
        # metadata is local; data never read is an error, in bounded time
        assert (old / "posix" / "sizes" / "one_mib").stat().st_size == MIB
        p = subprocess.run([sys.executable, "-c", "import sys; open(sys.argv[1], 'rb').read()",
                            str(old / "posix" / "sizes" / "one_mib")],
                           capture_output=True, text=True, timeout=30, check=False)
        assert p.returncode != 0 and "Error" in p.stderr
        # a new daemon on the node: a new root gets fresh layer mounts over the
        # live blobs, the old root keeps failing until unmounted
        node.start()
        new = node.mount(cat, "posix:1", tmp_path / "new", kernel=True)
        assert len((new / "posix" / "sizes" / "one_mib").read_bytes()) == MIB
        assert _erofs_by_layer(node) == {d: 1 for d in image}  # the stale ones detached
        for mp in (old, new):
            r = subprocess.run([*cli, "umount", str(mp), "--root", str(node.paths.root)],
                               capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
            assert r.returncode == 0, r.stderr
            node.mounted.remove(mp)
        assert _erofs_by_layer(node) == {}
        r = subprocess.run([*cli, "umount", str(node.mnt), "--root", str(node.paths.root)],
                           capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
    finally:
        node.close()
    root = str(node.paths.root)
    left = [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(root)
            or m.mount_point.startswith(str(tmp_path))]
    assert left == []


def test_cli_chooses_the_lowers_and_stop_waits_for_roots(tmp_path: Path, store: ChunkStore,
                                                         cat: Catalog, image: list[str]) -> None:
    node_root = tmp_path / "node"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}
    env.pop("LAZYFS_LOWERS", None)
    cli = [sys.executable, "-m", "tools.cli", "--store", str(store.root)]

    def run(*args: str, ok: bool = True, extra: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([*cli, *args], capture_output=True, text=True, cwd=REPO,
                           env={**env, **(extra or {})}, check=False, timeout=60)
        assert (p.returncode == 0) == ok, p.stderr
        return p
    mps = [tmp_path / n for n in ("k", "f", "e")]
    for mp in mps:
        mp.mkdir()
    try:
        assert "kernel EROFS" in run("mount", "posix:1", str(mps[0]), "--root",
                                     str(node_root)).stdout
        assert "FUSE lowers" in run("mount", "posix:1", str(mps[1]), "--fuse", "--root",
                                    str(node_root)).stdout
        assert "FUSE lowers" in run("mount", "posix:1", str(mps[2]), "--root", str(node_root),
                                    extra={"LAZYFS_LOWERS": "fuse"}).stdout
        bad = run("mount", "posix:1", str(tmp_path), "--root", str(node_root), ok=False,
                  extra={"LAZYFS_LOWERS": "tree"})
        assert "LAZYFS_LOWERS" in bad.stderr
        busy = run("umount", str(node_root / "mnt"), "--root", str(node_root), ok=False)
        assert "still use the daemon" in busy.stderr
        assert len(list((node_root / "erofs-mnt").glob("*.json"))) == len(image)
        for mp in mps:
            run("umount", str(mp), "--root", str(node_root))
        assert erofsmounts.shared_mounts(NodePaths(node_root.absolute())) == {}
        run("umount", str(node_root / "mnt"), "--root", str(node_root))
    finally:
        for p in [*mps, *(node_root / "erofs-mnt").glob("*"), node_root / "mnt"]:
            while sysmount.find_mount(p) is not None:
                sysmount.umount(p, lazy=True)
        pid = node_root / "daemon.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text()), 9)
            except (ProcessLookupError, ValueError):
                pass


def test_explicit_kernel_path_errors_name_the_layer(node: LazyNode, cat: Catalog,
                                                    image: list[str], tmp_path: Path) -> None:
    # a meta image that is not one: the kernel refuses it, the error names it
    node.paths.erofs_images.mkdir(parents=True, exist_ok=True)
    bad = erofsmounts.image_path(node.paths, image[0])
    bad.write_bytes(b"\0" * 8192)
    with pytest.raises(MountError, match=f"layer {image[0]}.*meta.erofs"):
        node.mount(cat, "posix:1", tmp_path / "root", kernel=True)
    node.mounted.clear()
    assert sysmount.find_mount(tmp_path / "root") is None and _erofs_by_layer(node) == {}


@pytest.mark.slow
def test_debian_minbase_on_the_kernel_path(tmp_path: Path, store: ChunkStore, cat: Catalog
                                           ) -> None:
    from tests.test_lazyfs_debian import _debootstrap
    if not os.path.exists("/usr/sbin/debootstrap"):
        pytest.skip("debootstrap is not installed (install.sh installs it)")
    minbase = _debootstrap("debian-minbase", None, "usr/bin/dpkg")
    convert(store, cat, f"dir:{minbase}", "debian:minbase")
    with LazyNode(tmp_path / "node", Path(store.root), cache_size="2G") as node:
        root = node.mount(cat, "debian:minbase", tmp_path / "root", kernel=True)
        rw = node.mount(cat, "debian:minbase", tmp_path / "rw", writable=tmp_path / "w",
                        kernel=True)
        assert len(node.erofs_mounts()) == 1
        out = chroot_run(rw, "dpkg", "-l", timeout=60)
        assert "ii  dpkg" in out.stdout, out.stderr
        assert chroot_run(rw, "bash", "-c", "echo $((6*7)) > /answer; cat /answer"
                          ).stdout == "42\n"
        (layer,) = node.stats()["layers"].values()
        assert 0 < layer["touched_fraction"] < 0.2, layer
        assert diff_trees(minbase, root) == []
