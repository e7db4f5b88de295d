"""Garbage collection: roots, grace, repack, live readers, live writers."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest

from chunkstore import ChunkId, ChunkNotFound, ChunkStore, GcBusy, RootError, StoreConfig
from tests.helpers.support import pack_path, start_worker, stop


def test_unrooted_chunks_are_swept_and_space_reclaimed(store: ChunkStore,
                                                       store_path: Path) -> None:
    keep = [os.urandom(50_000) for _ in range(10)]
    drop = [os.urandom(50_000) for _ in range(30)]
    mixed = [d for pair in zip(keep, drop[:10]) for d in pair] + drop[10:]
    ids = store.put_many(mixed)
    keep_ids = ids[0:20:2]
    assert store.set_root("image:1", keep_ids) == 10
    before = store.stats()
    report = store.gc(grace_seconds=0)
    assert report.chunks_removed == 30
    assert report.packs_repacked == 1
    assert report.bytes_reclaimed >= 30 * 50_000
    after = store.stats()
    assert after.chunks == 10 and after.pack_bytes < before.pack_bytes
    assert store.get_many(keep_ids) == keep
    with pytest.raises(ChunkNotFound):
        store.get(ids[1])
    assert store.verify().ok
    # a second GC finds nothing to do
    again = store.gc(grace_seconds=0)
    assert again.chunks_removed == 0 and again.bytes_reclaimed == 0


def test_removing_a_root_frees_its_chunks(store: ChunkStore) -> None:
    a = store.put_many([os.urandom(10_000) for _ in range(5)])
    b = store.put_many([os.urandom(10_000) for _ in range(5)])
    store.set_root("a", a)
    store.set_root("b", b + a[:1])
    assert sorted(store.roots()) == ["a", "b"]
    assert store.remove_root("a")
    assert not store.remove_root("a")
    store.gc(grace_seconds=0)
    assert store.has_many(a) == [True] + [False] * 4
    assert all(store.has_many(b))


def test_set_root_rejects_unknown_chunks(store: ChunkStore) -> None:
    from chunkstore import ChunkId
    cid = store.put(b"real")
    with pytest.raises(RootError, match="not stored"):
        store.set_root("r", [cid, ChunkId.of(b"imaginary")])
    assert store.roots() == []


def test_grace_period_keeps_fresh_and_recently_used_chunks(store: ChunkStore) -> None:
    old = store.put(os.urandom(1000))
    reused = store.put(os.urandom(2000))
    time.sleep(1.2)  # the test: `old` and `reused` outlive the 1 s grace period
    store.put(store.get(reused))  # a dedup hit refreshes it
    fresh = store.put(os.urandom(3000))
    report = store.gc(grace_seconds=1.0)
    assert report.chunks_removed == 1
    assert not store.has(old)
    assert store.has(reused) and store.has(fresh)
    assert store.gc(grace_seconds=3600).chunks_removed == 0


def test_only_one_gc_at_a_time(store: ChunkStore, store_path: Path) -> None:
    store.put(b"x" * 100)
    fd = os.open(store_path / "gc.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(GcBusy, match="another garbage collection"):
            store.gc()
    finally:
        os.close(fd)


@pytest.mark.slow
def test_gc_is_safe_for_live_readers(store_path: Path) -> None:
    cfg = StoreConfig(pack_size=1 << 20, threads=1)
    with ChunkStore.open(store_path, config=cfg) as store:
        live_data = [os.urandom(30_000) for _ in range(60)]
        live: list[ChunkId] = []
        for k in range(6):  # live chunks interleaved with garbage in every pack
            batch = live_data[k * 10:(k + 1) * 10] + [os.urandom(30_000) for _ in range(25)]
            live += store.put_many(batch)[:10]
        store.set_root("live", live)
        reader = start_worker("reader", str(store_path), ",".join(str(c) for c in live), "6")
        try:
            assert reader.stdout is not None
            assert json.loads(reader.stdout.readline()) == {"ready": True}
            repacked = 0
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                report = store.gc(grace_seconds=0, repack_threshold=0.9)
                repacked += report.packs_repacked
                assert not report.corrupt
                store.put_many([os.urandom(30_000) for _ in range(20)])  # more garbage
            out, err = reader.communicate(timeout=60)
            assert reader.returncode == 0, err
            assert json.loads(out.splitlines()[-1])["reads"] > 0
        finally:
            stop(reader)
        assert repacked >= 6
        assert store.get_many(live) == live_data
        assert store.verify().ok


@pytest.mark.slow
def test_gc_leaves_packs_of_live_writers_alone(store_path: Path) -> None:
    ChunkStore.open(store_path).close()
    holder = start_worker("holder", str(store_path))
    try:
        assert holder.stdout is not None
        info = json.loads(holder.stdout.readline())
        pack = pack_path(store_path, info["pack"])
        with ChunkStore.open(store_path) as store:
            report = store.gc(grace_seconds=0)
            assert report.chunks_removed == 1  # unrooted, so swept from the index…
            assert report.packs_in_use == 1
            assert pack.exists()  # …but the writer's pack is left alone
    finally:
        stop(holder)
    with ChunkStore.open(store_path) as store:
        report = store.gc(grace_seconds=0)
        assert report.packs_deleted == 1 and not pack.exists()


def test_report_says_what_the_grace_period_kept(store: ChunkStore) -> None:
    """An unreferenced chunk younger than the grace period is kept and
    reported as such (count, bytes, packs, time left); with no grace it goes
    and the report names nothing kept."""
    ids = store.put_many([os.urandom(40_000) for _ in range(3)])
    store.set_root("keep", ids[:1])
    r = store.gc(grace_seconds=3600)
    assert (r.chunks_removed, r.chunks_rooted, r.grace_seconds) == (0, 1, 3600)
    assert (r.young.chunks, r.young.packs) == (2, 1)
    assert 80_000 < r.young.stored_bytes < 81_000  # two incompressible records
    assert 3500 < r.young.seconds_left <= 3600
    r = store.gc(grace_seconds=0)
    assert (r.chunks_removed, r.chunks_rooted, r.young.chunks, r.young.stored_bytes) == \
        (2, 1, 0, 0)
