"""EROFS images computed from layer manifests (pmem/erofs.py), checked
against the kernel: the meta image mounted with mount(2) and its blob as
device 1, either materialized from the chunk store or served lazily by the
lazyfs daemon (`blobs/<digest>.data`). The mounts must equal the trees the
layers came from, compose as overlayfs lowers into the extracted image,
fetch only what is read, and fail with EIO (never wrong bytes, never a
hang) when a chunk is corrupt or the daemon dies."""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from chunkstore import TRUSTED, ChunkStore
from composer.bloblayout import BLOCK, BlobLayout, BlobPiece
from composer.catalog import Catalog
from composer.convert import convert
from composer.manifest import ChunkRef, Entry, Kind, LayerManifest
from composer.tarlayer import import_tar
from lazyfs import sysmount
from lazyfs.blob import map_size
from pmem.erofs import build_image, materialize_blob, write_image
from pmem.errors import UnrepresentableEntry
from tests.helpers.images import (
    EPOCH_NS,
    add_special_files,
    build_busybox_rootfs,
    chroot_run,
    extract_layers,
    tar_of,
)
from tests.helpers.images import whiteout_layer as make_whiteout_layer
from tests.helpers.lazynode import LazyNode, fuse_missing
from tests.helpers.support import flip_byte, pack_path, root_only
from tests.helpers.treediff import data_extents, diff_trees
from tests.test_lazyfs import make_image

MIB = 1 << 20
CHUNK = 256 << 10  # the converter's default chunk size

needs_fuse = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))


@contextmanager
def erofs_mount(meta: Path, blob: Path, target: Path) -> Iterator[Path]:
    """The kernel EROFS mount of a meta image with blob as device 1, from
    files (no loop device); unmounted after, lazily if busy or dead."""
    target.mkdir(parents=True, exist_ok=True)
    sysmount.mount(str(meta), target, "erofs", sysmount.MS_RDONLY, f"device={blob}")
    try:
        yield target
    finally:
        _unmount(target)


@contextmanager
def overlay(lowers: list[Path], target: Path) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    sysmount.mount("overlay", target, "overlay", sysmount.MS_RDONLY,
                   "lowerdir=" + ":".join(str(p) for p in lowers))
    try:
        yield target
    finally:
        _unmount(target)


def _unmount(target: Path) -> None:
    while sysmount.find_mount(target) is not None:
        try:
            sysmount.umount(target)
        except OSError:
            sysmount.umount(target, lazy=True)


def _layer_image(store: ChunkStore, m: LayerManifest, d: Path, name: str) -> tuple[Path, Path]:
    """Meta image and a materialized blob of a layer, in d."""
    meta = d / f"{name}.meta.erofs"
    image = write_image(m, meta, layer=name)
    blob = d / f"{name}.data"
    materialize_blob(m, image.layout, lambda ids: store.get_many(ids, m.domain), blob)
    return meta, blob


def _import(store: ChunkStore, tar: Path) -> LayerManifest:
    with open(tar, "rb") as f:
        return import_tar(store, f, layer=str(tar), domain=TRUSTED)


# -- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The lazyfs tests' tricky image (devices, hardlinks, xattrs, sparse,
    10,000-entry dir, 255-byte names, 40-deep path; an upper layer with
    whiteouts and an opaque dir), plus a tree of edge cases for EROFS."""
    d = tmp_path_factory.mktemp("erofsimg")
    base = build_busybox_rootfs(d / "base")
    add_special_files(base)
    upper = make_whiteout_layer(d / "upper", remove=["etc/hostname", "posix/big/f00007"],
                                opaque=["posix/deep"], add={"posix/deep/new": b"new\n",
                                                            "etc/motd": b"hello\n"}, like=base)
    edges = _edge_tree(d / "edges")
    out = {"base": base, "upper": upper, "edges": edges,
           "base.tar": tar_of(base, d / "base.tar"), "upper.tar": tar_of(upper, d / "upper.tar"),
           "edges.tar": tar_of(edges, d / "edges.tar")}
    out["ref"] = extract_layers([out["base.tar"], out["upper.tar"]], d / "ref")
    return out


def _edge_tree(root: Path) -> Path:
    """Files at and around block and chunk boundaries, directories whose
    entries fill blocks exactly or spill over with 255-byte names, ids past
    16 bits, mtimes that are not the layer's common one."""
    rng = random.Random(7)
    sizes = root / "sizes"
    sizes.mkdir(parents=True)
    for n in (0, 1, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 4097):
        (sizes / f"s{n}").write_bytes(rng.randbytes(n))
    # sparse: a hole at the start, data at a chunk boundary, a hole at the end
    with open(sizes / "sparse_edges", "wb") as f:
        f.truncate(8 * MIB)
        f.seek(4 * MIB - 10)
        f.write(rng.randbytes(20))
    os.link(sizes / "s4097", sizes / "s4097.link")
    # one block exactly: ".", ".." and 16 names whose dirents sum to 4096 bytes
    exact = root / "exact_block"
    exact.mkdir()
    for k in range(15):
        (exact / (chr(ord("a") + k) * 255)).write_bytes(b"")
    (exact / ("z" * 52)).write_bytes(b"")
    # many blocks of long names (~15 a block), and one name more than a block holds
    longs = root / "long_names"
    longs.mkdir()
    for k in range(600):
        (longs / (f"{k:04d}-" + "n" * 250)).write_bytes(f"{k}\n".encode())
    ids = root / "ids"
    ids.mkdir()
    (ids / "big_ids").write_bytes(b"uid 100000 gid 200000\n")
    os.chown(ids / "big_ids", 100_000, 200_000)
    os.chown(ids, 70_000, 65_536)
    for p in [root, *root.rglob("*")]:
        os.utime(p, ns=(EPOCH_NS, EPOCH_NS), follow_symlinks=False)
    os.utime(ids / "big_ids", ns=(EPOCH_NS + 1, EPOCH_NS + 1))
    os.utime(sizes / "s1", ns=(-1_500_000_000_123, -1_500_000_000_123))
    return root


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChunkStore]:
    s = ChunkStore.open(tmp_path_factory.mktemp("erofsstore") / "store")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def layers(shared_store: ChunkStore, trees: dict[str, Path]) -> dict[str, LayerManifest]:
    return {name: _import(shared_store, trees[f"{name}.tar"])
            for name in ("base", "upper", "edges")}


# -- the writer against the kernel --------------------------------------------------


@root_only
def test_kernel_mount_equals_the_layer(shared_store: ChunkStore, trees: dict[str, Path],
                                       layers: dict[str, LayerManifest], tmp_path: Path) -> None:
    for name in ("base", "edges"):
        meta, blob = _layer_image(shared_store, layers[name], tmp_path, name)
        with erofs_mount(meta, blob, tmp_path / f"mnt-{name}") as mnt:
            assert diff_trees(trees[name], mnt) == [], name
            if name == "base":
                st = os.stat(mnt / "posix" / "links" / "one")
                assert st.st_nlink == 3 and st.st_ino == \
                    os.stat(mnt / "posix" / "elsewhere" / "three").st_ino
                assert len(os.listdir(mnt / "posix" / "big")) == 10_000
                # holes stay holes (at EROFS chunk granularity) and take no blob space
                (start, end), = data_extents(mnt / "posix" / "sizes" / "sparse")
                assert start <= 32 * MIB < 32 * MIB + 4096 <= end and end - start <= MIB
            else:
                assert os.stat(mnt / "ids" / "big_ids").st_uid == 100_000
                assert os.stat(mnt / "sizes" / "s1").st_mtime_ns == -1_500_000_000_123
        # the blob is mostly the layer's data, not a copy of its holes
        assert os.path.getsize(blob) < layers[name].data_size + 48 * MIB


@root_only
def test_whiteouts_and_opaque_dirs_compose_in_overlayfs(shared_store: ChunkStore,
                                                        trees: dict[str, Path],
                                                        layers: dict[str, LayerManifest],
                                                        tmp_path: Path) -> None:
    base = _layer_image(shared_store, layers["base"], tmp_path, "base")
    upper = _layer_image(shared_store, layers["upper"], tmp_path, "upper")
    with erofs_mount(*base, tmp_path / "base") as b, erofs_mount(*upper, tmp_path / "up") as u:
        wh = os.lstat(u / "etc" / "hostname")
        assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == os.makedev(0, 0)
        assert os.getxattr(u / "posix" / "deep", "trusted.overlay.opaque") == b"y"
        with overlay([u, b], tmp_path / "root") as root:
            assert diff_trees(trees["ref"], root) == []


@pytest.mark.skipif(shutil.which("fsck.erofs") is None,
                    reason="fsck.erofs is not installed (install.sh installs erofs-utils)")
def test_fsck_erofs_accepts_the_images(shared_store: ChunkStore, trees: dict[str, Path],
                                       layers: dict[str, LayerManifest], tmp_path: Path) -> None:
    for name in ("base", "edges"):
        meta, blob = _layer_image(shared_store, layers[name], tmp_path, name)
        p = subprocess.run(["fsck.erofs", f"--device={blob}", str(meta)], capture_output=True,
                           text=True, check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        out = tmp_path / f"extract-{name}"
        p = subprocess.run(["fsck.erofs", f"--device={blob}", f"--extract={out}", str(meta)],
                           capture_output=True, text=True, check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        # erofs-utils 1.5 extracts neither xattrs nor hardlinks and cuts sparse
        # files at their last data chunk: compare what it does extract
        for path in trees[name].rglob("*"):
            rel = path.relative_to(trees[name])
            if path.is_symlink():
                assert os.readlink(out / rel) == os.readlink(path), rel
            elif path.is_file() and "sparse" not in path.name:
                assert (out / rel).read_bytes() == path.read_bytes(), rel


def test_images_are_deterministic(layers: dict[str, LayerManifest]) -> None:
    m = layers["base"]
    a = build_image(m, layer="x")
    again = build_image(LayerManifest.deserialize(m.serialize()), layer="x")
    assert a.meta == again.meta and a.layout == again.layout
    assert len(a.meta) % BLOCK == 0 and a.blob_size % BLOCK == 0
    # compact inodes for most of the tricky tree (its common mtime is the epoch)
    assert a.stats.compact > 10_000 and a.stats.extended < 20
    assert a.stats.skipped_xattrs == []


def test_blob_layout_maps_blob_bytes_back_to_files(layers: dict[str, LayerManifest]) -> None:
    m = layers["edges"]
    layout = BlobLayout.build(m)
    at = {e.path: i for i, e in enumerate(m.entries)}
    # every file starts on a block and reads back as itself from offset 0
    for name in ("sizes/s1", "sizes/s4095", "sizes/s4096", "sizes/s262145"):
        i = at[name]
        (block,) = layout.placements[i].blocks
        size = m.entries[i].size
        assert layout.locate(block * BLOCK, size) == [BlobPiece(i, 0, size)]
    assert layout.placements[at["sizes/s0"]].blocks == ()
    assert at["sizes/s4097.link"] not in layout.placements  # a hardlink has no data of its own
    # across a file's end: its last bytes, zero padding to the block, the next file
    i = at["sizes/s4097"]
    (block,) = layout.placements[i].blocks
    pieces = layout.locate(block * BLOCK + 4000, 2 * BLOCK + 100)
    assert pieces[:2] == [BlobPiece(i, 4000, 97), BlobPiece(-1, 0, 2 * BLOCK - 4097)]
    assert len(pieces) == 3 and pieces[2].file_offset == 0 and pieces[2].length == 4100
    # a sparse file: only the chunks holding data are in the blob (the
    # converter keeps the two 256 KiB chunks around the data at 4 MiB)
    i = at["sizes/sparse_edges"]
    p = layout.placements[i]
    used = [b for b in p.blocks if b >= 0]
    chunk = 1 << p.chunkbits
    data = [k for k, c in enumerate(m.entries[i].chunks) if c.id is not None]
    assert data == [4 * MIB // CHUNK - 1, 4 * MIB // CHUNK]
    assert len(used) * chunk == 2 * CHUNK and used == list(range(used[0], used[-1] + 1,
                                                               chunk // BLOCK))
    assert layout.locate(used[0] * BLOCK, 2 * CHUNK) == [BlobPiece(i, data[0] * CHUNK, 2 * CHUNK)]
    # pieces cover exactly the range asked, cut at the end of the blob
    rng = random.Random(1)
    for _ in range(500):
        off = rng.randrange(layout.size + 10)
        n = rng.choice([1, 4095, 4096, 4097, CHUNK, 3 * MIB])
        pieces = layout.locate(off, n)
        assert sum(p.length for p in pieces) == max(0, min(off + n, layout.size) - off)
        assert all(p.file_offset + p.length <= m.entries[p.entry].size
                   for p in pieces if p.entry >= 0)
    # identical files share one range of the blob
    same = [ChunkRef(m.entries[at["sizes/s4096"]].chunks[0].id, 4096)]
    twins = LayerManifest([Entry("", Kind.DIR, 0o755),
                           Entry("a", Kind.FILE, 0o644, size=4096, chunks=same),
                           Entry("b", Kind.FILE, 0o644, size=4096, chunks=same)])
    t = BlobLayout.build(twins)
    assert t.placements[1] == t.placements[2] and t.size == BLOCK


def test_what_erofs_cannot_hold_is_named() -> None:
    root = Entry("", Kind.DIR, 0o755)
    odd = LayerManifest([root, Entry("f", Kind.FILE, 0o644, xattrs={
        "system.nfs4_acl": b"x", "user.ok": b"kept"})])
    image = build_image(odd, layer="odd")
    assert image.stats.skipped_xattrs == [("f", "system.nfs4_acl")]
    too_long = LayerManifest([root, Entry("n" * 256, Kind.FILE, 0o644)])
    with pytest.raises(UnrepresentableEntry, match="n{256}.*256 bytes"):
        build_image(too_long, layer="long")
    # a file whose chunks are all holes takes no blob space at all
    holes = LayerManifest([root, Entry("h", Kind.FILE, 0o644, size=64 * MIB,
                                       chunks=[ChunkRef(None, 64 * MIB)])])
    assert build_image(holes, layer="holes").blob_size == 0


# -- through the lazyfs daemon ---------------------------------------------------------


@pytest.fixture
def image(store: ChunkStore, cat: Catalog, trees: dict[str, Path]) -> list[str]:
    return make_image(store, cat, "posix:1", [trees["base.tar"], trees["upper.tar"]])


@root_only
@needs_fuse
def test_kernel_mount_over_the_daemon_blob_is_lazy(store: ChunkStore, cat: Catalog,
                                                   image: list[str], trees: dict[str, Path],
                                                   tmp_path: Path) -> None:
    metas = {}
    for digest in image:
        metas[digest] = tmp_path / f"{digest}.meta.erofs"
        write_image(cat.load_layer(digest), metas[digest], layer=digest)
    base_m = cat.load_layer(image[0])
    with LazyNode(tmp_path / "node", Path(store.root)) as node:
        blobs = {d: node.mnt / "blobs" / f"{d}.data" for d in image}
        assert os.path.getsize(blobs[image[0]]) == BlobLayout.build(base_m).size
        assert sorted(os.listdir(node.mnt / "blobs")) == sorted(
            f"{d}{suffix}" for d in image for suffix in (".data", ".map"))
        with erofs_mount(metas[image[0]], blobs[image[0]], tmp_path / "base") as base, \
                erofs_mount(metas[image[1]], blobs[image[1]], tmp_path / "upper") as up:
            subprocess.run(["ls", "-lR", str(base), str(up)], check=True, capture_output=True)
            assert node.stats()["cache"]["misses"] == 0, "a metadata walk fetched data"
            names = ["posix/sizes/random_3mib", "posix/links/two", "bin/busybox"]
            for name in names:
                assert (base / name).read_bytes() == (trees["base"] / name).read_bytes()
            st = node.stats()
            layer = st["layers"][image[0]]
            by_path = {e.path: e for e in base_m.entries}
            read = {by_path[n].target if by_path[n].kind == Kind.HARDLINK else n for n in names}
            want = {c.id: c.length for e in base_m.entries if e.path in read for c in e.chunks}
            # exactly the chunks of the files read: no readahead into neighbours
            assert layer["files_touched"] == 3
            assert st["cache"]["fetched_bytes"] == sum(want.values())
            assert layer["touched_bytes"] == sum(e.size for e in base_m.entries
                                                 if e.path in read)
            trace = node.request({"op": "trace", "mount": None})["trace"]
            assert {e["path"] for e in trace["events"]} == read
            # the two EROFS layers as overlayfs lowers: the extracted image
            with overlay([up, base], tmp_path / "root") as root:
                assert diff_trees(trees["ref"], root) == []
            # the blob file itself: the same bytes as one built from the store
            local = tmp_path / "local.data"
            materialize_blob(base_m, BlobLayout.build(base_m),
                             lambda ids: store.get_many(ids), local)
            with open(blobs[image[0]], "rb") as served, open(local, "rb") as ref:
                while True:
                    a, b = served.read(4 * MIB), ref.read(4 * MIB)
                    assert a == b
                    if not a:
                        break


@root_only
@needs_fuse
def test_map_file_is_the_blob_padded_and_mapped_lazily(store: ChunkStore, cat: Catalog,
                                                       image: list[str], tmp_path: Path) -> None:
    """blobs/<digest>.map (what VMs map as virtio-pmem): the blob's bytes, then
    zeros up to whole 2 MiB units; it can be mapped shared (the direct_io
    .data cannot), and touching one page of the mapping fetches only the
    chunks behind that page."""
    m = cat.load_layer(image[0])
    layout = BlobLayout.build(m)
    entry_index = next(i for i, e in enumerate(m.entries) if e.path == "posix/sizes/random_3mib")
    entry = m.entries[entry_index]
    start = next(layout.starts[k] for k in range(len(layout.starts))
                 if layout.entries[k] == entry_index and layout.offsets[k] == 0)
    with LazyNode(tmp_path / "node", Path(store.root)) as node:
        data, mapped = (node.mnt / "blobs" / f"{image[0]}{s}" for s in (".data", ".map"))
        assert os.path.getsize(mapped) == map_size(layout.size)
        assert os.path.getsize(mapped) % (2 * MIB) == 0 and map_size(layout.size) > layout.size
        with open(data, "rb") as f, pytest.raises(OSError):
            mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
        with open(mapped, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
            try:
                first_chunk = entry.chunks[0].id
                assert first_chunk is not None
                page = mm[start:start + 4096]  # a page fault on the FUSE file
                assert page == store.get(first_chunk)[:4096]
                st = node.stats()
                # the fault read the chunk(s) behind that page (and FUSE readahead
                # around it), not the layer
                assert 0 < st["cache"]["fetched_bytes"] < layout.size // 2, st["cache"]
                assert mm[layout.size:] == bytes(map_size(layout.size) - layout.size)
            finally:
                mm.close()
            f.seek(0)
            assert f.read(layout.size) == materialized(m, layout, store, tmp_path)


def materialized(m: LayerManifest, layout: BlobLayout, store: ChunkStore, d: Path) -> bytes:
    local = d / "local.data"
    materialize_blob(m, layout, lambda ids: store.get_many(ids), local)
    return local.read_bytes()


@root_only
@needs_fuse
def test_corrupt_chunk_under_erofs_is_eio(store: ChunkStore, cat: Catalog, image: list[str],
                                          tmp_path: Path) -> None:
    m = cat.load_layer(image[0])
    entry = next(e for e in m.entries if e.path == "posix/sizes/random_3mib")
    cid = entry.chunks[-1].id
    assert cid is not None
    info = store.stat(cid)
    flip_byte(pack_path(Path(store.root), info.pack), info.offset + info.stored_len - 3)
    meta = tmp_path / "base.meta.erofs"
    write_image(m, meta, layer=image[0])
    with LazyNode(tmp_path / "node", Path(store.root)) as node:
        blob = node.mnt / "blobs" / f"{image[0]}.data"
        with erofs_mount(meta, blob, tmp_path / "base") as base:
            f = base / "posix" / "sizes" / "random_3mib"
            with open(f, "rb") as fh:
                assert len(fh.read(4096)) == 4096  # chunk 0 is fine
                fh.seek(entry.size - 4096)
                with pytest.raises(OSError) as e:
                    fh.read(4096)
            assert e.value.errno == errno.EIO
            assert node.stats()["errors"] >= 1
            assert str(cid) in node.log() and "posix/sizes/random_3mib" in node.log()


@root_only
@needs_fuse
def test_a_dead_daemon_gives_errors_not_hangs(store: ChunkStore, cat: Catalog,
                                              image: list[str], tmp_path: Path) -> None:
    m = cat.load_layer(image[0])
    meta = tmp_path / "base.meta.erofs"
    write_image(m, meta, layer=image[0])
    node = LazyNode(tmp_path / "node", Path(store.root))
    node.start()
    target = tmp_path / "base"
    try:
        with erofs_mount(meta, node.mnt / "blobs" / f"{image[0]}.data", target) as base:
            assert (base / "etc" / "passwd").read_bytes().startswith(b"root:")
            node.kill()
            # metadata is local and still there; data the daemon never served is an error
            assert (base / "posix" / "sizes" / "one_mib").stat().st_size == MIB
            p = subprocess.run([sys.executable, "-c", "import sys; open(sys.argv[1], 'rb').read()",
                                str(base / "posix" / "sizes" / "one_mib")],
                               capture_output=True, text=True, timeout=30, check=False)
            assert p.returncode != 0 and "Error" in p.stderr
    finally:
        _unmount(target)
        node.close()
    assert sysmount.find_mount(target) is None and sysmount.find_mount(node.mnt) is None


# -- a real distribution -------------------------------------------------------------


@pytest.fixture(scope="module")
def minbase() -> Path:
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is not installed (install.sh installs it)")
    from tests.test_lazyfs_debian import _debootstrap
    return _debootstrap("debian-minbase", None, "usr/bin/dpkg")


@pytest.mark.slow
@root_only
@needs_fuse
def test_debian_minbase_through_the_kernel_path(store: ChunkStore, cat: Catalog, minbase: Path,
                                                tmp_path: Path) -> None:
    convert(store, cat, f"dir:{minbase}", "debian:minbase")
    (digest,) = cat.resolve("debian:minbase")[1].layers
    meta = tmp_path / "minbase.meta.erofs"
    image = write_image(cat.load_layer(digest), meta, layer=digest)
    assert image.stats.skipped_xattrs == [] and len(image.meta) < 4 * MIB
    with LazyNode(tmp_path / "node", Path(store.root), cache_size="2G") as node, \
            erofs_mount(meta, node.mnt / "blobs" / f"{digest}.data", tmp_path / "root") as root:
        assert "ii  dpkg" in chroot_run(root, "dpkg", "-l", timeout=60).stdout
        layer = node.stats()["layers"][digest]
        assert 0 < layer["touched_fraction"] < 0.2, layer  # lazy: most of the image untouched
        assert diff_trees(minbase, root) == []
