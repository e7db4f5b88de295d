"""The node chunk cache in front of a real chunk store: bounded with LRU
eviction, persistent across reopen, one fetch per chunk however many threads
want it, corrupt cache files dropped and refetched, one owner at a time."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from chunkstore import TRUSTED, ChunkCorrupt, ChunkId, ChunkNotFound, ChunkStore, TrustDomain
from chunkstore.cache import CacheBusy, NodeCache
from tests.helpers.support import flip_byte, pack_path


class CountingSource:
    """The real store, with its calls counted (and, for the single-flight test,
    slowed down so that readers overlap: a delay the store cannot be asked for)."""

    def __init__(self, store: ChunkStore, delay: float = 0.0) -> None:
        self.store = store
        self.delay = delay
        self.calls: list[list[ChunkId]] = []
        self.lock = threading.Lock()

    def get_many(self, ids: Sequence[ChunkId], domain: TrustDomain = TRUSTED) -> list[bytes]:
        with self.lock:
            self.calls.append(list(ids))
        time.sleep(self.delay)
        return self.store.get_many(ids, domain)


def _chunks(store: ChunkStore, n: int, size: int = 64 << 10) -> tuple[list[ChunkId], list[bytes]]:
    datas = [os.urandom(size) for _ in range(n)]
    return store.put_many(datas), datas


def test_bounded_lru_and_persistent(store: ChunkStore, tmp_path: Path) -> None:
    ids, datas = _chunks(store, 10)
    src = CountingSource(store)
    dom = TrustDomain("trusted")
    with NodeCache.open(tmp_path / "c", capacity=5 * (64 << 10), source=src) as cache:
        for cid, data in zip(ids, datas, strict=True):
            assert cache.get(cid, dom) == data
        cache.flush()  # fills are written in the background
        assert cache.size <= 5 * (64 << 10) and len(cache) == 5
        assert cache.stats.evictions == 5
        assert not cache.contains(ids[0], dom) and cache.contains(ids[-1], dom)
        files = [p for p in (tmp_path / "c").rglob("*") if p.is_file() and p.parent.name != "tmp"
                 and p.name != ".lock"]
        assert len(files) == 5
    with NodeCache.open(tmp_path / "c", capacity=5 * (64 << 10), source=src) as cache:
        calls = len(src.calls)
        assert [cache.get(c, dom) for c in ids[5:]] == datas[5:]
        assert len(src.calls) == calls, "a reopened cache fetched what it had"
        # a smaller bound at reopen evicts down to it
    with NodeCache.open(tmp_path / "c", capacity=2 * (64 << 10), source=src) as cache:
        assert len(cache) == 2


def test_single_flight(store: ChunkStore, tmp_path: Path) -> None:
    ids, datas = _chunks(store, 4)
    src = CountingSource(store, delay=0.3)
    dom = TrustDomain("trusted")
    results: list[list[bytes]] = []
    with NodeCache.open(tmp_path / "c", capacity=1 << 30, source=src) as cache:
        threads = [threading.Thread(target=lambda: results.append(cache.get_many(ids, dom)))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [datas] * 8
        fetched = [c for call in src.calls for c in call]
        assert sorted(fetched) == sorted(ids), "each chunk fetched exactly once"
        assert cache.stats.waits > 0


def test_errors_are_shared_and_nothing_is_kept(store: ChunkStore, tmp_path: Path) -> None:
    missing = ChunkId(b"\x01" * 16)
    with NodeCache.open(tmp_path / "c", capacity=1 << 20, source=store) as cache:
        with pytest.raises(ChunkNotFound):
            cache.get(missing, TrustDomain("trusted"))
        assert len(cache) == 0 and not any((tmp_path / "c" / "tmp").iterdir())
        with pytest.raises(ChunkNotFound):  # not remembered as in flight
            cache.get(missing, TrustDomain("trusted"))


def test_corrupt_cache_file_is_dropped_and_refetched(store: ChunkStore, tmp_path: Path) -> None:
    ids, datas = _chunks(store, 1)
    src = CountingSource(store)
    dom = TrustDomain("trusted")
    with NodeCache.open(tmp_path / "c", capacity=1 << 30, source=src) as cache:
        cache.get(ids[0], dom)
        cache.flush()
        path = next(p for p in (tmp_path / "c").rglob(ids[0].hex()))
        raw = bytearray(path.read_bytes())
        raw[100] ^= 0xFF
        path.write_bytes(bytes(raw))
        assert cache.get(ids[0], dom) == datas[0]
        assert cache.stats.corrupt_dropped == 1 and len(src.calls) == 2
        cache.flush()
        assert path.read_bytes() == datas[0]


def test_one_owner(store: ChunkStore, tmp_path: Path) -> None:
    with NodeCache.open(tmp_path / "c", capacity=1 << 20, source=store), \
            pytest.raises(CacheBusy, match=f"pid {os.getpid()}"):
        NodeCache.open(tmp_path / "c", capacity=1 << 20, source=store)
    with pytest.raises(ValueError, match="capacity"):
        NodeCache.open(tmp_path / "d", capacity=0, source=store)


def _in_thread(fn: object, timeout: float = 10.0) -> object:
    """Run fn in a thread; fail (instead of hanging the suite) if it blocks."""
    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(_call(fn)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the cache call hung"
    return box[0]


def _call(fn: object) -> object:
    try:
        return fn()  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - returned to the test
        return e


def test_a_failed_call_never_leaves_chunks_claimed(store: ChunkStore, tmp_path: Path) -> None:
    ids, datas = _chunks(store, 2)
    dom = TrustDomain("trusted")
    with NodeCache.open(tmp_path / "c", capacity=1 << 30, source=store) as cache:
        cache.get(ids[1], dom)
        cache.flush()
        # chunk 1's cache file turns into something unreadable (EISDIR)
        path = next((tmp_path / "c").rglob(ids[1].hex()))
        path.unlink()
        path.mkdir()
        got = _in_thread(lambda: cache.get_many([ids[0], ids[1]], dom))
        assert isinstance(got, IsADirectoryError)
        # chunk 0 was claimed by that call: it must not stay "in flight"
        assert _in_thread(lambda: cache.get(ids[0], dom)) == datas[0]


def test_one_bad_chunk_fails_only_its_readers(store: ChunkStore, tmp_path: Path) -> None:
    ids, datas = _chunks(store, 3)
    info = store.stat(ids[1])
    flip_byte(pack_path(Path(store.root), info.pack), info.offset + info.stored_len - 3)
    dom = TrustDomain("trusted")
    with NodeCache.open(tmp_path / "c", capacity=1 << 30, source=store) as cache:
        with pytest.raises(ChunkCorrupt):
            cache.get_many(ids, dom)  # a batch (a prefetch, say) with one bad chunk
        # the good ones were fetched one by one and are served; the bad one fails
        assert cache.contains(ids[0], dom) and cache.contains(ids[2], dom)
        assert cache.get_many([ids[0], ids[2]], dom) == [datas[0], datas[2]]
        with pytest.raises(ChunkCorrupt):
            cache.get(ids[1], dom)


def test_domains_cannot_escape_the_cache_directory(store: ChunkStore, tmp_path: Path) -> None:
    evil = TrustDomain("../../escape")
    ids = store.put_many([b"x" * 5000], evil)
    with NodeCache.open(tmp_path / "c", capacity=1 << 30, source=store) as cache:
        assert cache.get(ids[0], evil) == b"x" * 5000
        cache.flush()
    assert not (tmp_path.parent / "escape").exists()
    assert [p.name for p in (tmp_path / "c").iterdir() if p.name.startswith("dom-")] == \
        ["dom-..%2F..%2Fescape"]
    with NodeCache.open(tmp_path / "c", capacity=1 << 30, source=store) as cache:
        assert cache.contains(ids[0], evil)  # found again after a restart
