"""lazyfs over real FUSE and real overlayfs: a node daemon serving layers
lazily, composed roots (read-only and writable) that equal the extracted
image, real programs run from them, tracing and prefetch, and failures
(corrupt chunk, killed daemon) that end in EIO/ENOTCONN and clean mounts."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import TRUSTED, ChunkStore, StoreConfig
from composer.catalog import Catalog, Image
from composer.tarlayer import import_tar
from lazyfs import sysmount
from lazyfs.node import store_catalog
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

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))]


def make_image(store: ChunkStore, cat: Catalog, tag: str, tars: list[Path], *,
               composition: bool = False) -> list[str]:
    """The layers of tars stored and committed as one image; with
    composition, also the image's stored composition (as a conversion)."""
    stored = {}
    digests = []
    manifests = []
    for tar in tars:
        with open(tar, "rb") as f:
            m = import_tar(store, f, layer=str(tar), domain=TRUSTED)
        digest, ids = cat.store_layer(m)
        stored[digest] = (m, ids)
        digests.append(digest)
        manifests.append(m)
    cat.commit_image(tag, Image(digests, {"Cmd": ["/bin/sh"]}, "test"), stored,
                     manifests=manifests if composition else None)
    return digests


@pytest.fixture(scope="module")
def image_tars(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("lazyimg")
    base = build_busybox_rootfs(d / "base")
    add_special_files(base)  # devices, hardlinks, xattrs, sparse, 10,000-entry dir, ...
    upper = whiteout_layer(d / "upper", remove=["etc/hostname", "posix/big/f00007"],
                           opaque=["posix/deep"], add={"posix/deep/new": b"new\n",
                                                       "etc/motd": b"hello\n"}, like=base)
    tars = {"base": tar_of(base, d / "base.tar"), "upper": tar_of(upper, d / "upper.tar")}
    tars["ref"] = extract_layers([tars["base"], tars["upper"]], d / "ref")
    return tars


@pytest.fixture
def node(tmp_path: Path, store: ChunkStore) -> Iterator[LazyNode]:
    with LazyNode(tmp_path / "node", Path(store.root)) as n:
        yield n


@pytest.fixture
def image(store: ChunkStore, cat: Catalog, image_tars: dict[str, Path]) -> list[str]:
    return make_image(store, cat, "posix:1", [image_tars["base"], image_tars["upper"]])


def test_composed_root_equals_the_extracted_image(node: LazyNode, cat: Catalog,
                                                  image: list[str], image_tars: dict[str, Path],
                                                  tmp_path: Path) -> None:
    ro = node.mount(cat, "posix:1", tmp_path / "ro")
    assert node.stats()["cache"]["misses"] == 0, "mounting fetched file data"
    assert diff_trees(image_tars["ref"], ro) == []
    rw = node.mount(cat, "posix:1", tmp_path / "rw", writable=tmp_path / "w")
    assert diff_trees(image_tars["ref"], rw) == []
    # the layer trees themselves, as the daemon serves them
    base = node.layer_dir(image[0])
    assert (base / "posix" / "links" / "one").stat().st_ino == \
        (base / "posix" / "elsewhere" / "three").stat().st_ino
    assert (base / "posix" / "links" / "one").stat().st_nlink == 3
    assert len(os.listdir(base / "posix" / "big")) == 10_000
    wh = os.lstat(node.layer_dir(image[1]) / "etc" / "hostname")
    assert (os.major(wh.st_rdev), os.minor(wh.st_rdev)) == (0, 0)  # an overlayfs whiteout
    assert os.getxattr(node.layer_dir(image[1]) / "posix" / "deep",
                       "trusted.overlay.opaque") == b"y"
    with pytest.raises(OSError) as e:
        (base / "etc" / "new").write_text("x")
    assert e.value.errno == errno.EROFS


def test_reads_are_lazy_and_traced(node: LazyNode, cat: Catalog, image: list[str],
                                   image_tars: dict[str, Path], tmp_path: Path) -> None:
    # the FUSE tree path: per-mount attribution needs the reader's pid at open,
    # which a shared EROFS mount's blob does not have (tests/test_kernel_path.py)
    root = node.mount(cat, "posix:1", tmp_path / "ro", kernel=False)
    subprocess.run(["ls", "-lR", str(root)], check=True, capture_output=True)
    assert node.stats()["cache"]["misses"] == 0, "metadata walk fetched data"
    want = (image_tars["ref"] / "posix" / "sizes" / "random_3mib").read_bytes()
    # pread at and around chunk boundaries, backwards seeks, a read past EOF
    fd = os.open(root / "posix" / "sizes" / "random_3mib", os.O_RDONLY)
    try:
        rng = random.Random(3)
        offsets = [0, 262143, 262144, 262145, 3 * 262144 - 1, len(want) - 5, len(want) + 10]
        offsets += [rng.randrange(len(want)) for _ in range(50)]
        for off in offsets:
            n = rng.choice([1, 4096, 300_000, 1 << 20])
            assert os.pread(fd, n, off) == want[off:off + n], (off, n)
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            assert m[:] == want
    finally:
        os.close(fd)
    st = node.stats()
    layer = st["layers"][image[0]]
    assert layer["files_touched"] == 1 and layer["touched_bytes"] == len(want)
    assert 0 < layer["touched_fraction"] < 0.5
    mounts = {m["mount"]: m for m in st["mounts"]}
    assert mounts[""]["touched_bytes"] == len(want)  # this process is not in the root
    # exec from the mount: attributed to the composed root it runs in
    assert chroot_run(root, "/bin/busybox", "cat", "/etc/motd").stdout == "hello\n"
    mounts = {m["mount"]: m for m in node.stats()["mounts"]}
    assert mounts[str(root.absolute())]["files_touched"] >= 1
    trace = node.request({"op": "trace", "mount": None})["trace"]
    paths = [e["path"] for e in trace["events"]]
    assert paths[0] == "posix/sizes/random_3mib" and "bin/busybox" in paths


def test_writes_stay_in_their_own_upper(node: LazyNode, cat: Catalog, image: list[str],
                                        tmp_path: Path) -> None:
    a = node.mount(cat, "posix:1", tmp_path / "a", writable=tmp_path / "wa")
    b = node.mount(cat, "posix:1", tmp_path / "b", writable=tmp_path / "wb")
    original = (b / "bin" / "busybox").read_bytes()
    (a / "bin" / "busybox").write_bytes(b"#!/bin/sh\necho replaced\n")
    (a / "etc" / "motd").unlink()
    (a / "posix" / "fresh").mkdir()
    assert (b / "bin" / "busybox").read_bytes() == original
    assert (b / "etc" / "motd").read_text() == "hello\n"
    assert (node.layer_dir(image[0]) / "bin" / "busybox").read_bytes() == original
    assert (tmp_path / "wa" / "upper" / "bin" / "busybox").read_bytes().endswith(b"replaced\n")
    assert not (tmp_path / "wb" / "upper" / "bin" / "busybox").exists()
    assert chroot_run(b, "/bin/sh", "-c", "echo ok; ls /etc/motd").stdout == "ok\n/etc/motd\n"
    # remounting the same writable dir keeps the sandbox's changes
    node.unmount(a)
    a2 = node.mount(cat, "posix:1", tmp_path / "a2", writable=tmp_path / "wa")
    assert not (a2 / "etc" / "motd").exists() and (a2 / "posix" / "fresh").is_dir()


def test_prefetch_replays_a_trace_into_the_node_cache(node: LazyNode, cat: Catalog,
                                                      image: list[str],
                                                      tmp_path: Path) -> None:
    root = node.mount(cat, "posix:1", tmp_path / "ro")
    for name in ("posix/sizes/one_mib", "posix/sizes/random_3mib", "bin/busybox"):
        (root / name).read_bytes()
    trace = node.request({"op": "trace", "mount": None})["trace"]
    assert len(trace["events"]) >= 3
    node.request({"op": "drop_cache"})
    assert node.stats()["cache"]["chunks"] == 0
    before = node.stats()["cache"]["misses"]
    node.request({"op": "prefetch", "events": trace["events"]})
    wait_until(lambda: node.stats()["prefetch_runs"] >= 1, 20, "the prefetch run")
    st = node.stats()["cache"]
    assert st["chunks"] > 0
    # the same reads now hit the node cache: no new misses (page cache dropped first)
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
    after_prefetch = st["misses"]
    assert after_prefetch > before
    for name in ("posix/sizes/one_mib", "posix/sizes/random_3mib"):
        (root / name).read_bytes()
    assert node.stats()["cache"]["misses"] == after_prefetch


def test_node_cache_survives_a_daemon_restart(tmp_path: Path, store: ChunkStore,
                                              cat: Catalog, image: list[str]) -> None:
    # reads of a local store are kept in the node cache only when asked
    keep = ["--keep-local-reads"]
    with LazyNode(tmp_path / "node", Path(store.root), extra=keep) as node:
        (node.layer_dir(image[0]) / "posix" / "sizes" / "random_3mib").read_bytes()
        fetched = node.stats()["cache"]["fetched_bytes"]
        assert fetched >= 3 << 20
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
    with LazyNode(tmp_path / "node", Path(store.root), extra=keep) as node:
        (node.layer_dir(image[0]) / "posix" / "sizes" / "random_3mib").read_bytes()
        st = node.stats()["cache"]
        assert st["fetched_bytes"] == 0 and st["hits"] > 0


def test_corrupt_chunk_is_eio_and_named(tmp_path: Path, store: ChunkStore, cat: Catalog,
                                        image: list[str]) -> None:
    m = cat.load_layer(image[0])
    entry = next(e for e in m.entries if e.path == "posix/sizes/random_3mib")
    cid = entry.chunks[-1].id
    assert cid is not None
    info = store.stat(cid)
    flip_byte(pack_path(Path(store.root), info.pack), info.offset + info.stored_len - 3)
    with LazyNode(tmp_path / "node", Path(store.root)) as node:
        f = node.layer_dir(image[0]) / "posix" / "sizes" / "random_3mib"
        with open(f, "rb") as fh:
            assert len(fh.read(4096)) == 4096  # chunk 0 is fine
            with pytest.raises(OSError) as e:
                fh.seek(entry.size - 4096)
                fh.read(4096)
        assert e.value.errno == errno.EIO
        assert node.stats()["errors"] >= 1
        assert str(cid) in node.log() and "posix/sizes/random_3mib" in node.log()


def test_killed_daemon_gives_enotconn_and_cleans_up(tmp_path: Path, store: ChunkStore,
                                                    cat: Catalog, image: list[str]) -> None:
    node = LazyNode(tmp_path / "node", Path(store.root))
    node.start()
    try:
        root = node.mount(cat, "posix:1", tmp_path / "ro")
        node.kill()
        with pytest.raises(OSError) as e:
            os.stat(node.layer_dir(image[0]) / "posix" / "sizes" / "one_mib")
        assert e.value.errno == errno.ENOTCONN
        cli = [sys.executable, "-m", "tools.cli", "--store", str(store.root)]
        p = subprocess.run([*cli, "umount", str(root), "--root", str(node.paths.root)],
                           capture_output=True, text=True, cwd=REPO, check=False)
        assert p.returncode == 0, p.stderr
        node.mounted.clear()
        p = subprocess.run([*cli, "umount", str(node.mnt), "--root", str(node.paths.root)],
                           capture_output=True, text=True, cwd=REPO, check=False)
        assert p.returncode == 0, p.stderr
        assert sysmount.find_mount(node.mnt) is None and sysmount.find_mount(root) is None
        # and a new daemon starts on the same node root
        node.start()
        assert (node.layer_dir(image[0]) / "etc" / "motd").exists() is False
        assert (node.layer_dir(image[1]) / "etc" / "motd").read_text() == "hello\n"
    finally:
        node.close()
    assert sysmount.find_mount(node.mnt) is None


def test_cli_mount_starts_the_daemon_and_unmounts(tmp_path: Path, store: ChunkStore,
                                                  cat: Catalog, image: list[str]) -> None:
    node_root = tmp_path / "node"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}
    cli = [sys.executable, "-m", "tools.cli", "--store", str(store.root)]

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([*cli, *args], capture_output=True, text=True, cwd=REPO, env=env,
                           check=False, timeout=60)
        assert (p.returncode == 0) == ok, p.stderr
        return p
    mp = tmp_path / "mp"
    mp.mkdir()
    try:
        assert "MOUNTPOINT" in run("mount", "--help").stdout
        out = run("mount", "posix:1", str(mp), "--root", str(node_root)).stdout
        assert "mounted posix:1" in out
        assert (mp / "etc" / "motd").read_text() == "hello\n"
        stats = run("stats", "--root", str(node_root)).stdout
        assert "posix:1" in stats and "touched" in stats
        trace = tmp_path / "trace.json"
        run("stats", "--root", str(node_root), "--save-trace", str(trace))
        assert json.loads(trace.read_text())["events"][0]["path"] == "etc/motd"
        bad = run("mount", "no-such:image", str(tmp_path), "--root", str(node_root), ok=False)
        assert "no-such" in bad.stderr
        busy = run("umount", str(node_root / "mnt"), "--root", str(node_root), ok=False)
        assert "still use the daemon" in busy.stderr
        run("umount", str(mp), "--root", str(node_root))
        again = run("umount", str(mp), "--root", str(node_root), ok=False)
        assert "not mounted" in again.stderr
        # an environment spec: built, then mounted (posix:1 + a toolkit dir)
        tk = tmp_path / "tk"
        (tk / "bin").mkdir(parents=True)
        (tk / "bin" / "tool").write_text("#!/bin/sh\necho from the toolkit\n")
        (tk / "bin" / "tool").chmod(0o755)
        spec = tmp_path / "env.toml"
        spec.write_text(f'name = "env:1"\nbase = "posix:1"\ntoolkits = ["dir:{tk}"]\n')
        run("mount", str(spec), str(mp), "--root", str(node_root),
            "--writable", str(tmp_path / "envrw"))
        assert chroot_run(mp, "/bin/tool").stdout == "from the toolkit\n"
        run("umount", str(mp), "--root", str(node_root))
        # foreground: Ctrl-C unmounts
        fg = subprocess.Popen([*cli, "mount", "posix:1", str(mp), "--root", str(node_root),
                               "-f"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        assert fg.stdout is not None
        assert "mounted" in fg.stdout.readline()
        assert sysmount.find_mount(mp) is not None
        fg.send_signal(2)
        assert fg.wait(timeout=20) == 0
        fg.stdout.close()
        assert sysmount.find_mount(mp) is None
        run("umount", str(node_root / "mnt"), "--root", str(node_root))
        assert sysmount.find_mount(node_root / "mnt") is None
    finally:
        for p in (mp, node_root / "mnt"):
            while sysmount.find_mount(p) is not None:
                sysmount.umount(p, lazy=True)
        pid = node_root / "daemon.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text()), 9)
            except (ProcessLookupError, ValueError):
                pass


def test_hung_backend_gives_eio_in_bounded_time_then_recovers(
        tmp_path: Path, image_tars: dict[str, Path]) -> None:
    """A pack whose open never returns (a named pipe in its place: a real
    kernel object that blocks, standing in for a hung storage backend, which
    a local store cannot be asked to do) gives EIO after --fetch-timeout; once
    the pack is back, the same file reads correctly, without remounting."""
    # 1 MiB packs: the file's data lives in packs the daemon has not opened
    # yet when the image is mounted (manifests are stored last)
    with ChunkStore.open(tmp_path / "store", config=StoreConfig(pack_size=1 << 20)) as store, \
            store_catalog(store) as cat:
        image = make_image(store, cat, "posix:1", [image_tars["base"], image_tars["upper"]])
        m = cat.load_layer(image[0])
        entry = next(e for e in m.entries if e.path == "posix/sizes/random_3mib")
        assert entry.chunks[0].id is not None
        pack = pack_path(Path(store.root), store.stat(entry.chunks[0].id).pack)
        saved = pack.with_name(pack.name + ".away")
        with LazyNode(tmp_path / "node", Path(store.root),
                      extra=["--fetch-timeout", "2"]) as node:
            root = node.mount(cat, "posix:1", tmp_path / "ro")
            f = root / "posix" / "sizes" / "random_3mib"
            pack.rename(saved)
            os.mkfifo(pack)
            try:
                t0 = time.monotonic()
                with pytest.raises(OSError) as e:
                    f.read_bytes()
                assert e.value.errno == errno.EIO
                assert time.monotonic() - t0 < 15, "the read hung past the fetch timeout"
                assert "timed out" in node.log()
            finally:
                # release the worker thread stuck in open(), then put the pack back
                try:
                    os.close(os.open(pack, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
                pack.unlink()
                saved.rename(pack)
            deadline = time.monotonic() + 10
            while True:
                try:
                    data = f.read_bytes()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "reads did not recover"
                    time.sleep(0.2)
            assert data == (image_tars["ref"] / "posix/sizes/random_3mib").read_bytes()


def test_image_devices_and_setuid_do_not_work_on_the_host(node: LazyNode, cat: Catalog,
                                                          image: list[str],
                                                          tmp_path: Path) -> None:
    root = node.mount(cat, "posix:1", tmp_path / "ro")
    opts = sysmount.find_mount(root)
    assert opts is not None
    line = next(ln for ln in Path("/proc/self/mounts").read_text().splitlines()
                if ln.split()[1] == str(root))
    assert "nosuid" in line.split()[3] and "nodev" in line.split()[3]
    st = os.lstat(root / "posix" / "dev" / "chr")
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)  # the image says /dev/null
    with pytest.raises(PermissionError):
        open(root / "posix" / "dev" / "chr", "rb").close()
    # not even listable by other users: the node root is private
    assert os.stat(node.paths.root).st_mode & 0o777 == 0o700


def test_the_daemon_survives_bad_control_requests(node: LazyNode, cat: Catalog,
                                                  image: list[str]) -> None:
    import socket
    bad = [b"not json\n", b"[" * 200_000 + b"\n", b'{"op": "nope"}\n', b'{"no_op": 1}\n',
           b'{"op": "prefetch", "events": [{}]}\n', b'{"op": "prefetch", "events": 5}\n',
           # a well-formed trace event naming a layer this node does not have
           json.dumps({"op": "prefetch", "events": [{"layer": "blake3:" + "0" * 64,
                                                     "path": "x", "chunk": 0}]}).encode()
           + b"\n"]
    runs = node.stats()["prefetch_runs"]
    for req in bad:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(node.paths.control))
            s.sendall(req)
            answer = json.loads(s.recv(1 << 16))
        assert isinstance(answer, dict), req[:40]
        runs += "queued" in answer
    # the background prefetches (one of an unknown layer) have run
    wait_until(lambda: node.stats()["prefetch_runs"] >= runs, 20, "the queued prefetches")
    assert node.request({"op": "ping"})["ok"]
    assert node.proc is not None and node.proc.poll() is None
    assert (node.layer_dir(image[1]) / "etc" / "motd").read_text() == "hello\n"
