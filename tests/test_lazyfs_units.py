"""lazyfs pieces that need no mount: how a layer tree presents entries to
overlayfs, what a manifest from untrusted storage may not contain, which
layers a composed mount uses, and the fetch engine under the FUSE adapter."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio

from chunkstore import ChunkStore
from chunkstore.cache import NodeCache
from composer.bloblayout import BLOCK
from composer.compose import mount_layers, overlay_fixups
from composer.convert import convert
from composer.errors import ManifestError
from composer.manifest import Entry, Kind, LayerManifest
from lazyfs.errors import FetchError
from lazyfs.fetch import FetchEngine
from lazyfs.layers import Layers
from lazyfs.node import store_catalog
from lazyfs.options import Options
from lazyfs.trace import Tracer
from lazyfs.tree import OPAQUE_XATTR, LayerTree
from tests.helpers.lazynode import REPO
from tests.helpers.support import flip_byte, pack_path


def _layer(*entries: Entry) -> LayerManifest:
    return LayerManifest([Entry("", Kind.DIR, 0o755), *entries])


def test_overlay_control_xattrs_of_an_image_are_not_served() -> None:
    m = _layer(Entry("view", Kind.DIR, 0o755, opaque=True,
                     xattrs={"trusted.overlay.redirect": b"/etc", "user.overlay.origin": b"x",
                             "user.note": b"kept"}))
    tree = LayerTree.build("blake3:t", m, 2)
    i = tree.path_index("view")
    assert i is not None
    assert tree.xattrs(i) == {"user.note": b"kept", OPAQUE_XATTR: b"y"}
    assert tree.listed_xattrs(i) == ["user.note"]


@pytest.mark.parametrize(("path", "target"), [
    ("../etc", ""), ("/etc", ""), ("a/./b", ""), ("a//b", ""), ("a/\0", ""),
    ("link", "../../etc/passwd"), ("link", ""),
])
def test_unsafe_manifest_paths_are_refused(path: str, target: str) -> None:
    kind = Kind.HARDLINK if path == "link" else Kind.DIR
    raw = _layer(Entry("x", Kind.FILE, 0o644), Entry(path, kind, 0o755, target=target))
    blob = raw.serialize()
    with pytest.raises(ManifestError, match="unsafe path"):
        LayerManifest.deserialize(blob)


def _row_manifest(rows: list[object]) -> bytes:
    """A manifest blob with these rows, written as the builder writes one."""
    import msgpack
    import zstandard

    from composer.manifest import _HEADER, MAGIC, VERSION
    return _HEADER.pack(MAGIC, VERSION) + zstandard.ZstdCompressor().compress(
        msgpack.packb(["trusted", rows], use_bin_type=True))


def test_manifest_rows_are_checked_whatever_their_types() -> None:
    """Rows the builder wrote load as written (every kind, chunks, holes,
    xattrs, devices); a row with a field of another type (a bool for an
    integer, a string for bytes, a chunk id of the wrong length, chunks not
    covering the size) is a ManifestError naming it, never an entry."""
    from chunkstore import ChunkId
    from composer.manifest import ChunkRef
    entries = [Entry("", Kind.DIR, 0o755), Entry("f", Kind.FILE, 0o4755, 1, 2, 3, 10,
                                                  [ChunkRef(ChunkId(b"x" * 16), 6),
                                                   ChunkRef(None, 4)],
                                                  xattrs={"user.a": b"\0b"}),
               Entry("l", Kind.HARDLINK, target="f"), Entry("s", Kind.SYMLINK, target="/abs"),
               Entry("c", Kind.CHAR, rdev=(1, 3)), Entry("w", Kind.WHITEOUT),
               Entry("o", Kind.DIR, opaque=True, implicit=True)]
    good = LayerManifest(entries, "trusted")  # type: ignore[arg-type]
    assert LayerManifest.deserialize(good.serialize()).entries == entries
    row = entries[1].pack()
    for field, value, error in [(3, True, "integer"), (0, b"f", "string"),
                                (7, [[b"short", 10]], "16 bytes"),
                                (7, [[b"x" * 16, 9]], "chunks cover"),
                                (10, [["user.a", "text"]], "bytes"), (1, 99, "99")]:
        bad = list(row)
        bad[field] = value
        with pytest.raises(ManifestError, match=error):
            LayerManifest.deserialize(_row_manifest([entries[0].pack(), bad]))


def test_hardlink_to_a_directory_is_refused() -> None:
    m = _layer(Entry("d", Kind.DIR, 0o755), Entry("l", Kind.HARDLINK, target="d"))
    with pytest.raises(ValueError, match="hardlink"):
        LayerTree.build("blake3:t", m, 2)


def test_inodes_are_small_and_map_back() -> None:
    m = _layer(*[Entry(f"f{i}", Kind.FILE, 0o644) for i in range(10)])
    tree = LayerTree.build("blake3:t", m, 2)
    assert tree.root_inode == 3 and tree.inode(10) == 13 and tree.index(13) == 10


def test_an_opaque_root_hides_the_layers_below() -> None:
    base = _layer(Entry("old", Kind.FILE, 0o644))
    mid = _layer(Entry("mid", Kind.FILE, 0o644))
    top = LayerManifest([Entry("", Kind.DIR, 0o755, opaque=True),
                         Entry("new", Kind.FILE, 0o644)])
    kept, digests = mount_layers([base, mid, top], ["a", "b", "c"])
    assert digests == ["c"] and kept == [top]


def test_fixups_take_metadata_from_the_layer_that_listed_the_directory() -> None:
    base = LayerManifest([Entry("", Kind.DIR, 0o755, mtime_ns=5),
                          Entry("opt", Kind.DIR, 0o700, uid=7, mtime_ns=9)])
    tk = LayerManifest([Entry("", Kind.DIR, 0o755, implicit=True),
                        Entry("opt", Kind.DIR, 0o755, implicit=True),
                        Entry("opt/tk", Kind.DIR, 0o755)])
    fixes = {e.path: e for e in overlay_fixups([base, tk])}
    assert set(fixes) == {"", "opt"}
    assert (fixes["opt"].mode, fixes["opt"].uid, fixes["opt"].mtime_ns) == (0o700, 7, 9)


def test_a_layer_blob_takes_the_inodes_its_range_leaves_free() -> None:
    from lazyfs.blob import MAP_ALIGN, LayerBlob, blob_entry, blob_name, digest_of, map_name
    m = _layer(Entry("f", Kind.FILE, 0o644))
    tree = LayerTree.build("blake3:t", m, 3)
    blob = LayerBlob.build(tree)
    assert blob.inode == tree.base + len(tree.entries) + 1
    assert blob.map_inode == blob.inode + 1  # the next layer's base
    assert all(tree.inode(i) not in (blob.inode, blob.map_inode)
               for i in range(len(tree.entries)))
    assert digest_of(blob_name("blake3:t").encode()) == "blake3:t"
    assert blob_entry(map_name("blake3:t").encode()) == ("blake3:t", True)
    assert blob_entry(blob_name("blake3:t").encode()) == ("blake3:t", False)
    assert digest_of(b".data") is None and digest_of(b"blake3:t") is None
    assert blob_entry(b".map") == (None, False)
    assert blob.map_size % MAP_ALIGN == 0 and blob.map_size >= max(blob.size, MAP_ALIGN)


def test_the_fetch_engine_serves_a_layer_without_a_mount(tmp_path: Path) -> None:
    """The engine under the FUSE adapter, on its own: a real store, catalog
    and node cache; file and blob reads give the layer's bytes, a recorded
    trace replays into an empty cache, and a corrupt chunk is a FetchError
    (which the adapter answers with EIO), never wrong bytes."""
    rng = random.Random(3)
    src = tmp_path / "src"
    src.mkdir()
    big = rng.randbytes(700 << 10)  # three 256 KiB chunks
    (src / "big").write_bytes(big)
    (src / "small").write_bytes(b"small\n")
    with ChunkStore.open(tmp_path / "store") as store, store_catalog(store) as cat:
        convert(store, cat, f"dir:{src}", "t:1")
        [digest] = cat.resolve("t:1")[1].layers
        manifest = cat.load_layer(digest)

        def engine(cache: NodeCache, local: bool = False) -> FetchEngine:
            tracer = Tracer()
            return FetchEngine(cache, tracer, Layers(cat, tracer, 3), Options(),
                               local_store=store if local else None)

        async def reads(fe: FetchEngine) -> None:
            tree = await fe.layers.get(digest)
            i = tree.path_index("big")
            assert i is not None
            f = fe.open_file(tree, i, "m")
            assert bytes(await fe.read(f, 0, len(big) + 10)) == big
            assert bytes(await fe.read(f, (256 << 10) - 5, 10)) == big[(256 << 10) - 5:][:10]
            blob = await fe.layers.blob(digest)
            b = fe.open_blob(blob, "m")
            want = bytearray(blob.size)  # padding and holes read as zeros
            (p,) = blob.layout.placements[i].blocks  # one run: no holes
            want[p * BLOCK:p * BLOCK + len(big)] = big
            got = bytearray()
            for off in range(0, blob.size, 128 << 10):
                got += await fe.read_blob(b, off, 128 << 10)
            j = tree.path_index("small")
            assert j is not None
            (s,) = blob.layout.placements[j].blocks
            want[s * BLOCK:s * BLOCK + 6] = b"small\n"
            assert got == want
            assert fe.tracer.layers[digest].chunks  # traced as reads of the files

        with NodeCache.open(tmp_path / "cache1", source=store) as cache:
            fe = engine(cache)
            trio.run(reads, fe)
            events = fe.tracer.trace()["events"]
        with NodeCache.open(tmp_path / "cache2", source=store) as cache:
            fetched = trio.run(engine(cache).prefetch_trace, events)
            assert fetched == len({(e["path"], e["chunk"]) for e in events}) == 4

        cid = next(e for e in manifest.entries if e.path == "big").chunks[1].id
        assert cid is not None
        info = store.stat(cid)
        flip_byte(pack_path(Path(store.root), info.pack), info.offset + info.stored_len - 3)

        async def corrupt(fe: FetchEngine) -> None:
            tree = await fe.layers.get(digest)
            i = tree.path_index("big")
            assert i is not None
            with pytest.raises(FetchError, match="big"):
                await fe.read(fe.open_file(tree, i, "m"), 256 << 10, 4096)
            assert fe.tracer.errors == 1

        for local in (False, True):  # in a worker thread; on the event loop
            with NodeCache.open(tmp_path / f"cache3-{local}", source=store) as cache:
                trio.run(corrupt, engine(cache, local))


@pytest.mark.parametrize("local_source", [True, False])
def test_reads_keep_chunks_in_the_node_cache_only_from_a_remote_source(
        tmp_path: Path, local_source: bool) -> None:
    """Chunks a read fetched from the node's own store are not copied into
    the node cache (the store is on the same disk); from a remote source they
    are. A trace prefetch keeps them either way. The bytes are the file's,
    whether the fetch ran on the event loop (small, local) or in a thread."""
    rng = random.Random(5)
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i}": rng.randbytes(rng.choice([100, 5000, 300 << 10, 1300 << 10]))
             for i in range(12)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    with ChunkStore.open(tmp_path / "store") as store, store_catalog(store) as cat:
        convert(store, cat, f"dir:{src}", "t:1")
        [digest] = cat.resolve("t:1")[1].layers

        def engine(cache: NodeCache) -> FetchEngine:
            tracer = Tracer()
            return FetchEngine(cache, tracer, Layers(cat, tracer, 3), Options(),
                               local_store=store if local_source else None)

        async def read_all(fe: FetchEngine) -> None:
            tree = await fe.layers.get(digest)
            async with trio.open_nursery() as n:  # concurrent readers of every file
                for name, data in files.items():
                    for _ in range(2):
                        n.start_soon(read_one, fe, tree, name, data)

        async def read_one(fe: FetchEngine, tree: LayerTree, name: str, data: bytes) -> None:
            i = tree.path_index(name)
            assert i is not None
            f = fe.open_file(tree, i, "m")
            got = bytearray()
            while chunk := await fe.read(f, len(got), 128 << 10):
                got += chunk
            assert got == data, name

        with NodeCache.open(tmp_path / "cache1", source=store) as cache:
            fe = engine(cache)
            trio.run(read_all, fe)
            cache.flush()
            assert (len(cache) == 0) is local_source
            events = fe.tracer.trace()["events"]
        with NodeCache.open(tmp_path / "cache2", source=store) as cache:
            fetched = trio.run(engine(cache).prefetch_trace, events)
            cache.flush()
            assert fetched == len(cache) > 0


def test_a_daemon_spec_survives_its_command_line(tmp_path: Path) -> None:
    """What `lazyfs daemon` asks for is what `python -m lazyfs` runs with,
    the fetch tuning included."""
    from lazyfs.node import DaemonSpec, NodePaths
    spec = DaemonSpec(NodePaths(tmp_path / "node"), tmp_path / "store", None, tmp_path / "c",
                      options=Options(inline_fetch_bytes=0, keep_local_reads=True,
                                      readahead_chunks=5, hot_bytes=1 << 20))
    assert DaemonSpec.parse(spec.argv()) == spec
    # an option's own flag wins over the options the spec carries
    assert DaemonSpec.parse([*spec.argv(), "--no-keep-local-reads"]
                            ).options.keep_local_reads is False


def test_every_daemon_option_is_declared_once_and_reaches_each_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lazyfs.options.Options is the one declaration: every field with a
    flag is a flag of `lazyfs daemon` and of `python -m lazyfs`, every field
    a key of the config file's [daemon] section; flags win over the file,
    and a bad value is one line naming it."""
    import subprocess
    import sys

    from lazyfs import options as o
    from lazyfs.errors import ConfigError
    from lazyfs.node import DaemonSpec
    from lazyfs.settings import Settings
    helptext = subprocess.run([sys.executable, "-m", "tools.cli", "daemon", "--help"],
                              capture_output=True, text=True, check=True, cwd=REPO,
                              env={**os.environ, "COLUMNS": "200"}).stdout
    for name in o.names():
        assert (o.flag(name) in helptext) == o.spec(name).cli, name
    config = tmp_path / "config.toml"
    config.write_text("[daemon]\nfetch_timeout = 5.5\nnative_blobs = false\n"
                      "hot_bytes = 1048576\n")
    monkeypatch.setenv("LAZYFS_CONFIG", str(config))
    s = Settings.load(store_path=tmp_path / "store", node_root=tmp_path / "node")
    spec = DaemonSpec.from_settings(s, options={"fetch_timeout": 9.0, "fetch_threads": None})
    assert (spec.options.fetch_timeout, spec.options.native_blobs,
            spec.options.hot_bytes) == (9.0, False, 1 << 20)
    assert DaemonSpec.parse(spec.argv()).options == spec.options
    # the runtime's embedded node and its agent get the section too (and a
    # config stays a key of the embedded nodes' table: hashable)
    from runtime.agent.launch import dump_config, load_config
    from runtime.config import RuntimeConfig
    rc = RuntimeConfig.from_settings(s)
    assert (rc.daemon.fetch_timeout, rc.daemon.native_blobs) == (5.5, False)
    assert load_config(dump_config(rc)) == rc and {rc: 1}[load_config(dump_config(rc))] == 1
    with pytest.raises(ConfigError, match="unknown daemon option 'nope'"):
        RuntimeConfig(daemon={"nope": 1})  # type: ignore[arg-type]  # (a mapping works too)
    for text, why in (("[daemon]\nfetch_timeut = 1\n", "unknown daemon option 'fetch_timeut'"),
                      ("[daemon]\nfetch_threads = 0\n", "fetch_threads must be in 1..256"),
                      ("[daemon]\nnative_blobs = 1\n", "native_blobs must be true or false")):
        config.write_text(text)
        with pytest.raises(ConfigError, match=why) as e:
            Settings.load(store_path=tmp_path / "store")
        assert str(config) in str(e.value) and "\n" not in str(e.value)
    p = subprocess.run([sys.executable, "-m", "lazyfs", "--root", str(tmp_path), "--store",
                        str(tmp_path), "--cache", str(tmp_path), "--config", '{"x": 1}'],
                       capture_output=True, text=True, cwd=REPO, check=False)
    assert p.returncode == 1 and "unknown daemon option 'x'" in p.stderr


def test_runtime_settings_are_read_through_the_settings_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The VM backends' and the SDK's settings come from lazyfs.settings (the
    config file's [vm] and [client], their environment variables winning),
    read where they are used; no module but lazyfs.settings reads a LAZYFS_
    variable of its own."""
    import ast

    from lazyfs.errors import ConfigError
    from lazyfs.settings import setting
    from runtime.backends import snapshots
    from runtime.guest import kernel
    config = tmp_path / "config.toml"
    config.write_text(f'[vm]\nsnapshots = "{tmp_path}/snaps"\nkernel_cache = "{tmp_path}/k"\n'
                      f'[client]\nnode = "unix://{tmp_path}/agent.sock"\n')
    monkeypatch.setenv("LAZYFS_CONFIG", str(config))
    for var in ("LAZYFS_MICROVM_SNAPSHOTS", "LAZYFS_NODE", "LAZYFS_GUEST_KERNEL_CACHE"):
        monkeypatch.delenv(var, raising=False)
    assert snapshots.snapshot_dir() == tmp_path / "snaps"
    assert kernel.default_cache() == tmp_path / "k"
    assert setting("client_node") == f"unix://{tmp_path}/agent.sock"
    assert setting("pmem_cache") == Path("/var/cache/lazyfs/pmem")  # the default
    monkeypatch.setenv("LAZYFS_MICROVM_SNAPSHOTS", str(tmp_path / "env"))
    assert snapshots.snapshot_dir() == tmp_path / "env"  # the environment wins
    # the registry's credentials and the S3 endpoint reach the CLI's clients
    from lazyfs.node import open_cluster
    from tools.options import registry_options
    config.write_text('[registry]\nuser = "ann"\npassword = "pw"\n'
                      '[cluster]\ns3_endpoint = "http://127.0.0.1:9"\n')
    for var in ("LAZYFS_REGISTRY_USER", "LAZYFS_REGISTRY_PASSWORD", "LAZYFS_S3_ENDPOINT",
                "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    r = registry_options(platform="linux/arm64")
    assert (r.username, r.password, r.platform) == ("ann", "pw", "linux/arm64")
    assert registry_options(username="bob", password="x").username == "bob"
    with open_cluster("s3://bucket/p") as c:
        assert c.objects.client.meta.endpoint_url == "http://127.0.0.1:9"  # type: ignore[attr-defined]
    config.write_text("[vm]\nsnapshots = 3\n")
    monkeypatch.delenv("LAZYFS_MICROVM_SNAPSHOTS")
    with pytest.raises(ConfigError, match="vm_snapshots must be a string") as e:
        snapshots.snapshot_dir()
    assert str(config) in str(e.value)
    config.write_text("[vm]\nsnapshot = 3\n")
    with pytest.raises(ConfigError, match="unknown key vm.snapshot"):
        setting("vm_snapshots")
    reads = []
    for path in sorted(p for pkg in ("chunkstore", "composer", "pmem", "lazyfs", "runtime",
                                     "tools") for p in (REPO / pkg).rglob("*.py")
                       if p != REPO / "lazyfs" / "settings.py"):
        for call in ast.walk(ast.parse(path.read_text())):
            if isinstance(call, ast.Call) and "environ" in ast.unparse(call.func):
                reads += [f"{path.relative_to(REPO)}:{call.lineno} {a.value}" for a in call.args
                          if isinstance(a, ast.Constant) and isinstance(a.value, str)
                          and a.value.startswith("LAZYFS_")]
    assert not reads, reads
