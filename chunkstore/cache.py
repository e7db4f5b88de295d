"""The node-local chunk cache: what lazyfs reads through.

One directory per node, one file per chunk (plain bytes, named by trust
domain and id), bounded in bytes with least-recently-used eviction, shared by
every mount the node's daemon serves, and kept across daemon restarts (the
directory is rescanned at open; recency then starts from file mtimes).

    cache = NodeCache.open(path, capacity=4 << 30, source=store)
    data = cache.get_many(ids, domain)

* Single flight: a chunk wanted by many readers at once is fetched from the
  source once; the others wait for that fetch (and share its error).
* Never wrong bytes: a cached file is checked against its id (xxh3, ~10 GB/s)
  on every read; a file that fails is dropped, logged and fetched again. The
  source (ChunkStore) checks what it returns the same way.
* Atomic fills: a chunk is written under a temporary name and renamed, so a
  crash leaves no partial chunk visible; temporary files are removed at open.
  Fills run on a background thread after the reader has its bytes (a reader
  does not wait for the cache disk); until written, a chunk is served from
  memory. At most `max_pending` bytes wait to be written; past that, fills
  are written by the fetching thread (backpressure).
* Keeping is the caller's choice (`get_many(..., keep=False)`): a chunk
  whose source is a store on the same disk is cheaper to read from there
  again (one pread and a zstd decode, ~50 us here) than to write as a cache
  file (~330 us per file on this machine's ext4); lazyfs keeps those only
  when a prefetch asks for them.
* One owner: the directory is flocked while open; a second daemon on the same
  cache gets CacheBusy naming the holder.
* Thread-safe: lazyfs calls it from worker threads.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .errors import ChunkStoreError
from .ids import ChunkId, TrustDomain, id_digest
from .objects import ObjectStoreError

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 4 << 30
MAX_PENDING = 128 << 20
MAX_RECENT = 16 << 20
_LATENCY_SAMPLES = 4096


class CacheBusy(ChunkStoreError):
    """Another process holds the cache directory."""


class ChunkSource(Protocol):
    """Where misses are fetched from (a ChunkStore, a cluster backend)."""

    def get_many(self, ids: Sequence[ChunkId], domain: TrustDomain = ...) -> list[bytes]: ...


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    waits: int = 0  # requests served by another reader's in-flight fetch
    fetched_bytes: int = 0  # bytes brought in from the source
    served_bytes: int = 0
    evictions: int = 0
    corrupt_dropped: int = 0
    fetches: int = 0  # batched source calls
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=_LATENCY_SAMPLES))

    def percentile(self, q: float) -> float:
        """q-th percentile (0..100) of recent source fetch latencies, seconds."""
        data = sorted(self.latencies)
        if not data:
            return 0.0
        k = min(len(data) - 1, max(0, round(q / 100 * (len(data) - 1))))
        return data[k]


_Key = tuple[str, bytes]
_DOMAIN_PREFIX = "dom-"


@functools.lru_cache(maxsize=1024)
def _domain_dir(domain: str) -> str:
    """A trust domain as one safe directory name ('/' and '..' cannot escape)."""
    return _DOMAIN_PREFIX + urllib.parse.quote(domain, safe="")


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class NodeCache:
    def __init__(self, root: Path, capacity: int, source: ChunkSource,
                 lock_fd: int) -> None:
        self.root = root
        self.capacity = capacity
        self.source = source
        self.stats = CacheStats()
        self._lock_fd = lock_fd
        self._mu = threading.Lock()
        self._lru: collections.OrderedDict[_Key, int] = collections.OrderedDict()
        self._bytes = 0
        self._inflight: dict[_Key, Future[bytes]] = {}
        self._pending: dict[_Key, bytes] = {}  # fetched, not yet on disk
        self._pending_bytes = 0
        self.max_pending = MAX_PENDING
        # fetched with keep=False, most recent last: a reader that missed the
        # fetch in flight finds them here instead of fetching them again
        self._recent: collections.OrderedDict[_Key, bytes] = collections.OrderedDict()
        self._recent_bytes = 0
        self.max_recent = MAX_RECENT
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="cache-fill")
        self._tmp_seq = 0

    # -- opening -------------------------------------------------------------

    @classmethod
    def open(cls, root: str | os.PathLike[str], *, capacity: int = DEFAULT_CAPACITY,
             source: ChunkSource) -> NodeCache:
        if capacity <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        path = Path(root)
        path.mkdir(parents=True, exist_ok=True)
        (path / "tmp").mkdir(exist_ok=True)
        fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CacheBusy(f"node cache {path} is in use by another process "
                            f"(pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        cache = cls(path, capacity, source, fd)
        cache._scan()
        return cache

    def close(self) -> None:
        self._filler.shutdown(wait=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> NodeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _scan(self) -> None:
        for tmp in (self.root / "tmp").iterdir():
            tmp.unlink(missing_ok=True)
        found: list[tuple[int, _Key, int]] = []
        for ddir in self.root.iterdir():
            if not ddir.name.startswith(_DOMAIN_PREFIX) or not ddir.is_dir():
                continue
            domain = urllib.parse.unquote(ddir.name[len(_DOMAIN_PREFIX):])
            for sub in ddir.iterdir():
                if not sub.is_dir():
                    continue
                for f in os.scandir(sub):
                    try:
                        key = (domain, bytes.fromhex(f.name))
                        st = f.stat()
                    except (ValueError, OSError):
                        continue
                    found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._bytes += size
        self._evict()

    # -- reading -------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._lru)

    def contains(self, chunk_id: ChunkId, domain: TrustDomain) -> bool:
        key = (str(domain), bytes(chunk_id))
        with self._mu:
            return key in self._lru or key in self._pending or key in self._recent

    def get(self, chunk_id: ChunkId, domain: TrustDomain) -> bytes:
        return self.get_many([chunk_id], domain)[0]

    def keep(self, chunk_id: ChunkId, domain: TrustDomain, data: bytes) -> bool:
        """Keep a chunk the caller already has (read with keep=False, its
        bytes checked then) on disk, written in the background; False when
        it is kept already."""
        key = (str(domain), bytes(chunk_id))
        with self._mu:
            if key in self._lru or key in self._pending:
                return False
            self._pending[key] = data
            self._pending_bytes += len(data)
        try:
            self._filler.submit(self._fill, [(key, data)])
        except RuntimeError:  # closing: write it here
            self._fill([(key, data)])
        return True

    def get_many(self, ids: Sequence[ChunkId], domain: TrustDomain, *,
                 wait_timeout: float | None = None, keep: bool = True) -> list[bytes]:
        """The plain bytes of each chunk, in order: from the cache when there,
        else fetched from the source (once, however many ask at the same time)
        and, with `keep`, written to the cache. Waiting for another reader's
        fetch gives up after wait_timeout seconds (TimeoutError)."""
        dname = str(domain)
        out: dict[bytes, bytes] = {}
        claimed: list[ChunkId] = []
        waiting: list[tuple[bytes, Future[bytes]]] = []
        try:
            for cid in dict.fromkeys(ids):
                key = (dname, bytes(cid))
                while (data := self._read_cached(key, cid)) is None:
                    with self._mu:
                        # a fetch may have ended since _read_cached looked: the
                        # look and the claim are one step, or a chunk fetched
                        # a moment ago would be fetched again
                        if key in self._lru or key in self._pending or key in self._recent:
                            continue
                        fut = self._inflight.get(key)
                        if fut is None:
                            self._inflight[key] = Future()
                            claimed.append(cid)
                            self.stats.misses += 1
                        else:
                            self.stats.waits += 1
                    if fut is not None:
                        waiting.append((bytes(cid), fut))
                    break
                if data is not None:
                    out[bytes(cid)] = data
            if claimed:
                self._fetch(claimed, domain, out, keep)
                claimed = []
        except BaseException as e:
            # every chunk this call claimed must be resolved, or its waiters hang
            self._fail(claimed, dname, e)
            raise
        for raw, fut in waiting:
            out[raw] = fut.result(timeout=wait_timeout)
        result = [out[bytes(c)] for c in ids]
        with self._mu:
            self.stats.served_bytes += sum(len(d) for d in result)
        return result

    def _fail(self, ids: list[ChunkId], dname: str, error: BaseException) -> None:
        with self._mu:
            futs = [f for c in ids if (f := self._inflight.pop((dname, bytes(c)), None))]
        for fut in futs:
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # marks it retrieved when nobody waits

    def _path(self, key: _Key) -> str:
        # (strings, not pathlib: this runs for every chunk a read fills or finds)
        hexid = key[1].hex()
        return f"{self.root}/{_domain_dir(key[0])}/{hexid[:2]}/{hexid}"

    def _read_cached(self, key: _Key, cid: ChunkId) -> bytes | None:
        with self._mu:
            pending = self._pending.get(key) or self._recent.get(key)
            if pending is not None:
                self.stats.hits += 1
                return pending
            if key not in self._lru:
                return None
            self._lru.move_to_end(key)
        try:
            with open(self._path(key), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        if id_digest(data) != key[1]:
            log.error("node cache: chunk %s (domain %s) at %s is corrupt; dropped and "
                      "fetched again", cid, key[0], self._path(key))
            self._forget(key, unlink=True)
            with self._mu:
                self.stats.corrupt_dropped += 1
            return None
        with self._mu:
            self.stats.hits += 1
        return data

    def _fetch(self, ids: list[ChunkId], domain: TrustDomain, out: dict[bytes, bytes],
               keep: bool = True) -> None:
        dname = str(domain)
        t0 = time.perf_counter()
        try:
            datas = self.source.get_many(ids, domain)
        except Exception as e:
            if len(ids) == 1 or isinstance(e, ObjectStoreError):
                raise  # (a store that cannot be reached fails every chunk alike)
            # one bad chunk must not fail the readers of the others: retry one
            # by one, so each chunk gets its own result or its own error
            log.warning("node cache: batch of %d chunks failed (%s); fetching them one by one",
                        len(ids), e)
            first: Exception | None = None
            for cid in ids:
                try:
                    self._fetch([cid], domain, out, keep)
                except Exception as one:  # noqa: BLE001 - reported to that chunk's readers
                    self._fail([cid], dname, one)
                    first = first or one
            if first is not None:
                raise first from None
            return
        elapsed = time.perf_counter() - t0
        fills: list[tuple[_Key, bytes]] = []
        with self._mu:
            sync = self._pending_bytes > self.max_pending
            for cid, data in zip(ids, datas, strict=True) if not keep else ():
                key = (dname, bytes(cid))
                if key not in self._recent:
                    self._recent[key] = data
                    self._recent_bytes += len(data)
            while self._recent_bytes > self.max_recent and self._recent:
                self._recent_bytes -= len(self._recent.popitem(last=False)[1])
            for cid, data in zip(ids, datas, strict=True) if keep else ():
                key = (dname, bytes(cid))
                if key not in self._pending:
                    self._pending[key] = data
                    self._pending_bytes += len(data)
                    fills.append((key, data))
        for cid, data in zip(ids, datas, strict=True):
            out[bytes(cid)] = data
            with self._mu:
                fut = self._inflight.pop((dname, bytes(cid)))
            fut.set_result(data)
        if not fills:
            pass
        elif sync:
            self._fill(fills)
        else:
            try:
                self._filler.submit(self._fill, fills)
            except RuntimeError:  # closing: write them here
                self._fill(fills)
        with self._mu:
            self.stats.fetches += 1
            self.stats.fetched_bytes += sum(len(d) for d in datas)
            self.stats.latencies.append(elapsed)

    def _fill(self, fills: list[tuple[_Key, bytes]]) -> None:
        for key, data in fills:
            try:
                self._store(key, data)
            except OSError as e:  # a full cache disk must not fail the read
                log.warning("node cache: cannot keep chunk %s: %s", key[1].hex(), e)
            finally:
                with self._mu:
                    if self._pending.pop(key, None) is not None:
                        self._pending_bytes -= len(data)

    def flush(self) -> None:
        """Wait until every fetched chunk is on disk."""
        self._filler.submit(lambda: None).result()

    def _store(self, key: _Key, data: bytes) -> None:
        path = self._path(key)
        with self._mu:
            self._tmp_seq += 1
            tmp = f"{self.root}/tmp/{os.getpid()}.{threading.get_ident()}.{self._tmp_seq}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            try:
                os.rename(tmp, path)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.rename(tmp, path)
        except BaseException:
            _unlink(tmp)  # a full disk leaves no partial file behind
            raise
        with self._mu:
            old = self._lru.pop(key, None)
            if old is not None:
                self._bytes -= old
            self._lru[key] = len(data)
            self._bytes += len(data)
        self._evict()

    def _forget(self, key: _Key, *, unlink: bool = False) -> None:
        with self._mu:
            size = self._lru.pop(key, None)
            if size is not None:
                self._bytes -= size
        if unlink:
            _unlink(self._path(key))

    def _evict(self) -> None:
        victims: list[_Key] = []
        with self._mu:
            while self._bytes > self.capacity and self._lru:
                key, size = self._lru.popitem(last=False)
                self._bytes -= size
                victims.append(key)
            self.stats.evictions += len(victims)
        for key in victims:
            _unlink(self._path(key))

    def clear(self) -> None:
        """Drop every cached chunk (benchmarks: a cold node)."""
        self.flush()
        with self._mu:
            keys = list(self._lru)
            self._lru.clear()
            self._bytes = 0
            self._recent.clear()
            self._recent_bytes = 0
        for key in keys:
            _unlink(self._path(key))
