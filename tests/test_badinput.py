"""Bad input: every failure is a typed error naming what failed, and the store
stays usable afterwards."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from chunkstore import (
    ChunkCorrupt,
    ChunkId,
    ChunkNotFound,
    ChunkStore,
    StoreConfig,
    StoreFormatError,
    StoreFull,
    StoreReadOnly,
)
from chunkstore.index import Entry, Txn, chunk_key
from composer.convert import convert
from composer.errors import BadLayer
from lazyfs.node import store_catalog
from tests.helpers.support import flip_byte, mounted, pack_path, root_only

REPO = Path(__file__).resolve().parent.parent


def _three(store: ChunkStore) -> list[ChunkId]:
    return store.put_many([os.urandom(4000), b"compressible " * 1000, os.urandom(9000)])


def _still_usable(store: ChunkStore, good: list[ChunkId]) -> None:
    store.get_many(good)
    new = store.put(os.urandom(777))
    assert len(store.get(new)) == 777


def _rewrite_entry(store: ChunkStore, cid: ChunkId, **changes: int) -> None:
    def fn(txn: Txn) -> None:
        key = chunk_key(cid, 0)
        e = store.index.get(txn, key)
        assert e is not None
        fields = {f: getattr(e, f) for f in Entry.__slots__}
        fields.update(changes)
        txn.put(key, Entry(**fields).encode(), db=store.index.chunks)
    store.index.write(fn)


def test_unknown_id(store: ChunkStore) -> None:
    good = _three(store)
    missing = ChunkId.of(b"nobody stored this")
    with pytest.raises(ChunkNotFound, match=str(missing)) as info:
        store.get_many([good[0], missing])
    assert info.value.chunk_id == missing
    with pytest.raises(ChunkNotFound):
        store.stat(missing)
    _still_usable(store, good)


@pytest.mark.parametrize("target", ["data", "header"])
def test_flipped_byte_in_pack(store: ChunkStore, store_path: Path, target: str) -> None:
    good = _three(store)
    victim = good[2]
    info = store.stat(victim)
    where = info.offset + 100 if target == "data" else info.offset - 20
    flip_byte(pack_path(store_path, info.pack), where)
    with pytest.raises(ChunkCorrupt) as err:
        store.get(victim)
    assert err.value.chunk_id == victim
    assert f"{info.pack:016x}" in str(err.value)
    report = store.verify()
    assert [b.id for b in report.bad] == [victim]
    _still_usable(store, good[:2])


def test_flipped_byte_in_compressed_chunk(store: ChunkStore, store_path: Path) -> None:
    good = _three(store)
    info = store.stat(good[1])
    flip_byte(pack_path(store_path, info.pack), info.offset + info.stored_len // 2)
    with pytest.raises(ChunkCorrupt, match=str(good[1])):
        store.get(good[1])
    _still_usable(store, [good[0], good[2]])


def test_truncated_pack(store: ChunkStore, store_path: Path) -> None:
    good = _three(store)
    last = max(good, key=lambda c: store.stat(c).offset)
    info = store.stat(last)
    os.truncate(pack_path(store_path, info.pack), info.offset + 10)
    with pytest.raises(ChunkCorrupt, match="truncated"):
        store.get(last)
    assert [b.id for b in store.verify().bad] == [last]
    _still_usable(store, [c for c in good if c != last])


def test_index_pointing_past_end_of_pack(store: ChunkStore) -> None:
    good = _three(store)
    _rewrite_entry(store, good[0], offset=10_000_000)
    with pytest.raises(ChunkCorrupt, match="truncated") as err:
        store.get(good[0])
    assert err.value.chunk_id == good[0]
    _still_usable(store, good[1:])


def test_wrong_codec_byte_in_index(store: ChunkStore) -> None:
    good = _three(store)
    _rewrite_entry(store, good[1], codec=7)
    with pytest.raises(ChunkCorrupt, match="codec") as err:
        store.get(good[1])
    assert err.value.chunk_id == good[1]
    assert [b.id for b in store.verify().bad] == [good[1]]
    _still_usable(store, [good[0], good[2]])


def test_wrong_codec_byte_in_pack(store: ChunkStore, store_path: Path) -> None:
    good = _three(store)
    info = store.stat(good[1])
    path = pack_path(store_path, info.pack)
    with open(path, "r+b") as f:  # the codec byte sits at record offset 20
        f.seek(info.offset - 32 + 20)
        f.write(bytes([9]))
    with pytest.raises(ChunkCorrupt, match="codec 9/1"):
        store.get(good[1])
    _still_usable(store, [good[0], good[2]])


def test_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreFormatError, match="not a chunk store"):
        ChunkStore.open(tmp_path / "empty", readonly=True)
    with pytest.raises(StoreFormatError, match="no chunk store"):
        ChunkStore.open(tmp_path / "absent", create=False)


def test_newer_format_is_refused(store_path: Path) -> None:
    with ChunkStore.open(store_path) as s:
        s.index.write(lambda txn: txn.put(b"format", struct.pack(">I", 99), db=s.index.meta))
    with pytest.raises(StoreFormatError, match="format 99"):
        ChunkStore.open(store_path)


def test_readonly_open_refuses_writes(store_path: Path) -> None:
    with ChunkStore.open(store_path) as s:
        ids = _three(s)
    with ChunkStore.open(store_path, readonly=True) as s:
        assert len(s.get_many(ids)) == 3
        with pytest.raises(StoreReadOnly, match="read-only"):
            s.put(b"x")
        with pytest.raises(StoreReadOnly):
            s.set_root("r", ids)


@root_only
def test_store_on_read_only_filesystem(tmp_path: Path) -> None:
    src = tmp_path / "store"
    with ChunkStore.open(src) as s:
        ids = _three(s)
    with mounted("--bind", "-o", "ro", str(src), target=tmp_path / "ro") as ro:
        with pytest.raises(StoreReadOnly, match=str(ro)):
            ChunkStore.open(ro)
        with ChunkStore.open(ro, readonly=True) as s:
            assert len(s.get_many(ids)) == 3
            assert s.verify().ok
            with pytest.raises(StoreReadOnly):
                s.put(b"nope")
    with ChunkStore.open(src) as s:  # the store itself is untouched and writable
        _still_usable(s, ids)


@root_only
def test_disk_full(tmp_path: Path) -> None:
    with mounted("-t", "tmpfs", "-o", "size=6m", "tmpfs", target=tmp_path / "small") as small:
        cfg = StoreConfig(initial_map_size=1 << 20, batch_bytes=1 << 20, threads=1)
        with ChunkStore.open(small / "store", config=cfg) as s:
            ids = s.put_many([os.urandom(100_000) for _ in range(10)])
            with pytest.raises(StoreFull, match="no space left"):
                s.put_many([os.urandom(500_000) for _ in range(40)])
            # what was committed before is intact and readable
            assert len(s.get_many(ids)) == 10
            assert s.verify().ok
            # batches committed before the failure are whole chunks, merely
            # unreferenced: GC drops them; with the disk full it cannot copy
            # live data, and says so instead of failing
            s.set_root("keep", ids)
            report = s.gc(grace_seconds=0)
            assert report.chunks_before - report.chunks_removed == 10
            assert report.stopped == "" or "no space left" in report.stopped
        with ChunkStore.open(small / "store", config=cfg) as s:
            assert len(s.get_many(ids)) == 10
            more = s.put_many([os.urandom(10_000) for _ in range(5)])
            assert len(s.get_many(more)) == 5
            assert s.verify().ok


@pytest.mark.parametrize("changes", [
    {"offset": 0}, {"offset": 1 << 63}, {"offset": (1 << 64) - 1},
    {"stored_len": (1 << 32) - 1}, {"plain_len": (1 << 32) - 1}, {"pack": 999},
])
def test_impossible_index_entries_are_corruption(store: ChunkStore,
                                                 changes: dict[str, int]) -> None:
    good = _three(store)
    _rewrite_entry(store, good[0], **changes)
    with pytest.raises(ChunkCorrupt) as err:
        store.get(good[0])
    assert err.value.chunk_id == good[0]
    with pytest.raises(ChunkCorrupt):
        store.get_many(good)
    assert [b.id for b in store.verify().bad] == [good[0]]
    _still_usable(store, good[1:])


def test_non_byte_input_is_refused(store: ChunkStore) -> None:
    with pytest.raises(TypeError, match="bytes-like"):
        store.put_many(["text is not bytes"])  # type: ignore[list-item]


# -- the `lazyfs` command: every failure is one line on stderr and an exit code ----------

def _lazyfs(*args: str, tmp: Path, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "LAZYFS_STORE": str(tmp / "store"), "LAZYFS_CONFIG": "/nonexistent",
            "LAZYFS_CLUSTER": "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=120, check=False)


def _one_line(p: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code and len(lines) == 1, p.stderr
    assert lines[0].startswith("lazyfs: error: "), p.stderr
    for w in words:
        assert w in lines[0], p.stderr


@pytest.mark.parametrize(("args", "words"), [
    (["--cluster", "bogus://x", "images"], ["option --cluster", "unknown cluster store URL"]),
    (["--cluster", "s3://", "images"], ["option --cluster", "no bucket"]),
    (["--cluster", "posix://relative/dir", "cluster", "images"], ["must be absolute"]),
    (["--cluster", "posix:///nonexistent-cluster-dir", "cluster", "images"],
     ["/nonexistent-cluster-dir"]),
    (["--cluster", "s3://b?endpoint=http://127.0.0.1:9", "cluster", "images"],
     ["127.0.0.1:9"]),  # nothing listens on the discard port: unreachable
])
def test_bad_cluster_url_is_one_line(tmp_path: Path, args: list[str], words: list[str]) -> None:
    _one_line(_lazyfs(*args, tmp=tmp_path), 1, *words)
    # the same URL from the environment names the environment
    if args[-1] == "images" and args[-2] != "cluster":
        p = _lazyfs("images", tmp=tmp_path, env={"LAZYFS_CLUSTER": args[1]})
        _one_line(p, 1, "environment LAZYFS_CLUSTER")


def test_bad_settings_are_one_line(tmp_path: Path) -> None:
    _one_line(_lazyfs("--threads", "0", "store", "info", tmp=tmp_path), 1, "threads must be")
    _one_line(_lazyfs("stats", tmp=tmp_path, env={"LAZYFS_CACHE_SIZE": "tiny"}), 1,
              "environment LAZYFS_CACHE_SIZE", "'tiny'")
    cfg = tmp_path / "config.toml"
    cfg.write_text('[node]\nroot = 3\n')
    _one_line(_lazyfs("stats", tmp=tmp_path, env={"LAZYFS_CONFIG": str(cfg)}), 1,
              "node.root", "must be a string")
    cfg.write_text('[nodes]\nroot = "/x"\n')
    _one_line(_lazyfs("stats", tmp=tmp_path, env={"LAZYFS_CONFIG": str(cfg)}), 1,
              "unknown section", "nodes")


def test_node_errors_are_one_line(tmp_path: Path) -> None:
    root = tmp_path / "node"
    env = {"LAZYFS_NODE_ROOT": str(root)}
    # the daemon's errors (lazyfs.errors.DaemonError): none runs at the root
    _one_line(_lazyfs("umount", str(root / "mnt"), tmp=tmp_path, env=env), 1,
              "no lazyfs daemon serves", str(root / "mnt"))
    _one_line(_lazyfs("stats", tmp=tmp_path, env=env), 1, "no lazyfs daemon answers")
    # composed mounts' (lazyfs.errors.MountError): nothing is mounted there
    (tmp_path / "plain").mkdir()
    p = _lazyfs("umount", str(tmp_path / "plain"), tmp=tmp_path, env=env)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    dbg = _lazyfs("--debug", "umount", str(root / "mnt"), tmp=tmp_path, env=env)
    assert "Traceback" in dbg.stderr and "DaemonError" in dbg.stderr


def test_daemon_entry_point_errors_are_one_line(tmp_path: Path) -> None:
    """`python -m lazyfs` (how lazyfs.node starts a daemon) fails in one line too."""
    p = subprocess.run([sys.executable, "-m", "lazyfs", "--root", str(tmp_path / "node"),
                        "--store", str(tmp_path / "no-store"), "--cache", str(tmp_path / "c")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith("lazyfs daemon: error: ")
    if os.geteuid() == 0 and os.path.exists("/dev/fuse"):
        assert "no chunk store at" in lines[0]


def test_every_package_error_is_a_lazyfs_error() -> None:
    """The root the CLI maps to one line: each package's base derives from it."""
    from chunkstore.errors import ChunkStoreError, LazyfsError
    from composer.errors import ComposerError
    from lazyfs.errors import ConfigError, DaemonError, MountError, NodeError
    from pmem.errors import PmemError
    from runtime.errors import SandboxError
    from tools.errors import QuietError
    for cls in (ChunkStoreError, ComposerError, PmemError, NodeError, ConfigError,
                DaemonError, MountError, SandboxError, QuietError):
        assert issubclass(cls, LazyfsError), cls


def _store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@root_only
@pytest.mark.parametrize("fault", ["disk full", "truncated archive"])
def test_a_failed_conversion_stops_every_write(tmp_path: Path, fault: str) -> None:
    """Whichever side of a conversion fails (the store: a full disk on a
    later batch; the source: an archive cut short after batches were
    stored), that is the conversion's one error, no image is tagged, and
    nothing writes to the store once convert has returned (no storing
    thread left running)."""
    src = tmp_path / "layer.tar"
    with tarfile.open(src, "w") as tar:  # 96 MiB that does not compress
        for n in range(24):
            data = os.urandom(4 << 20)
            info = tarfile.TarInfo(f"f{n:02d}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    if fault == "truncated archive":
        os.truncate(src, src.stat().st_size - (5 << 20))
    before = {t.ident for t in threading.enumerate()}
    small = tmp_path / "small"
    size = "48m" if fault == "disk full" else "512m"
    with (mounted("-t", "tmpfs", "-o", f"size={size}", "tmpfs", target=small),
          ChunkStore.open(small / "store", create=True) as s, store_catalog(s) as cat):
        error = (StoreFull, "no space left") if fault == "disk full" else (BadLayer,
                                                                           "end of data")
        with pytest.raises(error[0], match=error[1]):
            convert(s, cat, f"tar:{src}", "big:1")
        written = [_store_bytes(small / "store")]
        time.sleep(1.0)
        written.append(_store_bytes(small / "store"))
        assert written[0] == written[1], f"the store was written after convert returned: {written}"
        assert cat.list_tags() == []
        # no storing thread is left behind
        assert not [t.name for t in threading.enumerate()
                    if t.ident not in before and t.name.startswith("layer-put")]
