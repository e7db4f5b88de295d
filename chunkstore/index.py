"""The LMDB index: chunk key -> where the chunk's bytes are, plus roots and meta.

Databases in one environment (`<root>/index/`):

    chunks   key = chunk id (16) | domain number u32    value = Entry (61 bytes)
    roots    key = root name, dupsort values = chunk keys (20 bytes, dupfixed)
    domains  key = trust domain name -> u32 domain number (0 = trusted)
    meta     format version, next pack number, next domain number

Keys sort by chunk id first, so every domain's copy of one id is one short
range scan away: that is how cross-domain dedup finds candidates.

LMDB's map is a fixed-size reservation; this module grows it (doubling) when a
write fills it, and adopts a size grown by another process, so the store never
fails because the map filled up. All LMDB errors are translated here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from .errors import ChunkStoreError, StoreFormatError, StoreFull, StoreReadOnly
from .ids import TRUSTED, ChunkId, PackId, TrustDomain

FORMAT_VERSION = 1
TRUSTED_NUMBER = 0

_ENTRY = struct.Struct(">QQIIBQ32s")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

T = TypeVar("T")

# py-lmdb types every value as bytes | memoryview even when buffers are off
# (as here); transactions are handled as Any rather than casting each read.
Txn = Any


@dataclass(frozen=True, slots=True)
class Entry:
    pack: PackId
    offset: int  # of the stored bytes (past the record header)
    stored_len: int
    plain_len: int
    codec: int
    touched: int  # unix milliseconds of the last put, dedup hit or root that named it
    strong: bytes  # BLAKE3-256 of the plain bytes

    def encode(self) -> bytes:
        return _ENTRY.pack(self.pack, self.offset, self.stored_len, self.plain_len,
                           self.codec, self.touched, self.strong)

    @classmethod
    def decode(cls, raw: bytes) -> Entry:
        p, o, s, n, c, t, h = _ENTRY.unpack(raw)
        return cls(PackId(p), o, s, n, c, t, h)

    @property
    def location(self) -> tuple[PackId, int]:
        return self.pack, self.offset

    def touched_at(self, now: int) -> Entry:
        return Entry(self.pack, self.offset, self.stored_len, self.plain_len,
                     self.codec, now, self.strong)

    def moved(self, pack: PackId, offset: int) -> Entry:
        return Entry(pack, offset, self.stored_len, self.plain_len,
                     self.codec, self.touched, self.strong)


def chunk_key(chunk_id: bytes, domain_number: int) -> bytes:
    return chunk_id + _U32.pack(domain_number)


def split_key(key: bytes) -> tuple[ChunkId, int]:
    return ChunkId(key[:16]), _U32.unpack(key[16:20])[0]


class _Gate:
    """Many transactions at once (shared), or none while the map is resized
    or the process forks (exclusive). py-lmdb's set_mapsize invalidates
    every open transaction of the process, and a read transaction inherited
    across fork must not exist: closing it in the child would clear the
    parent's reader slot in the shared lock file."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._exclusive = False
        self._pending = 0  # exclusive wanted: admit no new shared users

    def enter_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._pending:
                self._cond.wait()
            self._active += 1

    def exit_shared(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def want_exclusive(self) -> None:
        """Announce an exclusive section to come (called by a shared user),
        so that new shared users wait instead of starving it."""
        with self._cond:
            self._pending += 1

    def acquire_exclusive(self, announced: bool = False) -> None:
        with self._cond:
            if announced:
                self._pending -= 1
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._active:
                self._cond.wait()

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        self.acquire_exclusive()
        try:
            yield
        finally:
            self.release_exclusive()


_open_indexes: weakref.WeakSet[Index] = weakref.WeakSet()


def _before_fork() -> None:
    for index in list(_open_indexes):
        index.gate.acquire_exclusive()


def _after_fork_in_parent() -> None:
    for index in list(_open_indexes):
        index.gate.release_exclusive()


def _after_fork_in_child() -> None:
    for index in list(_open_indexes):
        index.gate = _Gate()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


class Index:
    def __init__(self, path: Path, *, readonly: bool, initial_map_size: int,
                 durable: bool = True) -> None:
        self.path = path
        self.readonly = readonly
        self.durable = durable
        self._pid = os.getpid()
        self.gate = _Gate()
        self._domain_cache: dict[str, int] = {TRUSTED: TRUSTED_NUMBER}
        self._domain_names: dict[int, str] = {TRUSTED_NUMBER: TRUSTED}
        self.env = self._open_env(initial_map_size)
        try:
            self.chunks = self.env.open_db(b"chunks", create=not readonly)
            self.roots = self.env.open_db(b"roots", dupsort=True, dupfixed=True,
                                          create=not readonly)
            self.domains = self.env.open_db(b"domains", create=not readonly)
            self.meta = self.env.open_db(b"meta", create=not readonly)
            self._check_format()
        except lmdb.NotFoundError as e:
            self.env.close()
            raise StoreFormatError(f"{path.parent} is not a chunk store "
                                   "(index without its databases)") from e
        except BaseException:
            self.env.close()
            raise
        _open_indexes.add(self)

    def _open_env(self, map_size: int) -> lmdb.Environment:
        # (not durable: commits are not fsynced either, as packs are not)
        kw: dict[str, Any] = {"subdir": True, "max_dbs": 8, "map_size": map_size,
                              "max_readers": 1024, "readahead": False,
                              "sync": self.durable, "metasync": self.durable}
        try:
            if self.readonly:
                # lock=True even here: LMDB copes with a read-only filesystem,
                # and without the lock a writer elsewhere could reuse pages
                # under our read transactions
                return lmdb.open(str(self.path), readonly=True, **kw)
            self.path.mkdir(parents=True, exist_ok=True)
            return lmdb.open(str(self.path), **kw)
        except lmdb.Error as e:
            raise self._translate(e, "open the index") from e

    def _translate(self, e: lmdb.Error, what: str) -> ChunkStoreError:
        text = str(e)
        if isinstance(e, lmdb.ReadonlyError) or "Read-only file system" in text \
                or "Permission denied" in text:
            return StoreReadOnly(self.path.parent, f"cannot {what}: {text}")
        if "No space left" in text or getattr(e, "errno", None) == errno.ENOSPC:
            return StoreFull(self.path.parent, f"the index ({what})")
        if isinstance(e, lmdb.CorruptedError | lmdb.InvalidError | lmdb.VersionMismatchError):
            return StoreFormatError(f"index at {self.path} is unusable ({what}): {text}")
        return ChunkStoreError(f"index at {self.path}: cannot {what}: {text}")

    def _check_format(self) -> None:
        with self.env.begin(db=self.meta, write=not self.readonly) as txn:
            raw = txn.get(b"format")
            if raw is None:
                if self.readonly:
                    raise StoreFormatError(f"{self.path.parent} is not a chunk store (no index)")
                txn.put(b"format", _U32.pack(FORMAT_VERSION))
            elif _U32.unpack(raw)[0] > FORMAT_VERSION:
                raise StoreFormatError(
                    f"{self.path.parent} uses index format {_U32.unpack(raw)[0]}, "
                    f"this lazyfs reads up to {FORMAT_VERSION}")

    # -- transactions with map growth ---------------------------------------

    def read(self, fn: Callable[[Txn], T]) -> T:
        for _ in range(8):
            gate = self.gate
            gate.enter_shared()
            try:
                with self.env.begin(write=False, buffers=False) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                pass
            except lmdb.Error as e:
                raise self._translate(e, "read") from e
            finally:
                gate.exit_shared()
            self._adopt_map_size()
        raise ChunkStoreError(f"index at {self.path}: map kept resizing under reads")

    def write(self, fn: Callable[[Txn], T]) -> T:
        if self.readonly:
            raise StoreReadOnly(self.path.parent)
        for _ in range(40):
            announced = False
            gate = self.gate
            gate.enter_shared()
            try:
                with self.env.begin(write=True) as txn:
                    try:
                        return fn(txn)
                    except lmdb.MapFullError:
                        # stop new readers before the abort: py-lmdb's abort
                        # waits for other threads' calls on the environment
                        gate.want_exclusive()
                        announced = True
                        raise
            except lmdb.MapFullError:
                grow = True
            except lmdb.MapResizedError:
                grow = False
            except lmdb.Error as e:
                raise self._translate(e, "write") from e
            finally:
                gate.exit_shared()
            # outside the transaction and the except clause: resizing needs
            # every transaction of this process closed
            if grow:
                self._grow(announced)
            else:
                self._adopt_map_size()
        raise ChunkStoreError(f"index at {self.path}: could not grow the LMDB map")

    def _grow(self, announced: bool = False) -> None:
        self.gate.acquire_exclusive(announced)
        try:
            size = self.env.info()["map_size"]
            self.env.set_mapsize(size * 2)
        finally:
            self.gate.release_exclusive()

    def _adopt_map_size(self) -> None:
        with self.gate.exclusive():
            self.env.set_mapsize(0)

    @property
    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    # -- meta ----------------------------------------------------------------

    def allocate_pack(self) -> PackId:
        def fn(txn: Txn) -> PackId:
            raw = txn.get(b"next_pack", db=self.meta)
            n = _U64.unpack(raw)[0] if raw else 1
            txn.put(b"next_pack", _U64.pack(n + 1), db=self.meta)
            return PackId(n)
        return self.write(fn)

    def domain_number(self, domain: TrustDomain, *, create: bool) -> int | None:
        if domain in self._domain_cache:
            return self._domain_cache[domain]
        key = domain.encode()

        def lookup(txn: Txn) -> int | None:
            raw = txn.get(key, db=self.domains)
            return None if raw is None else _U32.unpack(raw)[0]

        number = self.read(lookup)
        if number is None and create:
            def fn(txn: Txn) -> int:
                raw = txn.get(key, db=self.domains)
                if raw is not None:
                    return int(_U32.unpack(raw)[0])
                nraw = txn.get(b"next_domain", db=self.meta)
                n = _U32.unpack(nraw)[0] if nraw else 1
                txn.put(b"next_domain", _U32.pack(n + 1), db=self.meta)
                txn.put(key, _U32.pack(n), db=self.domains)
                return n
            number = self.write(fn)
        if number is not None:
            self._domain_cache[domain] = number
            self._domain_names[number] = domain
        return number

    def domain_name(self, number: int) -> TrustDomain:
        name = self._domain_names.get(number)
        if name is None:
            def fn(txn: Txn) -> dict[int, str]:
                return {_U32.unpack(v)[0]: k.decode()
                        for k, v in txn.cursor(db=self.domains)}
            for n, nm in self.read(fn).items():
                self._domain_names[n] = nm
                self._domain_cache[nm] = n
            name = self._domain_names.get(number, f"#{number}")
        return TrustDomain(name)

    # -- entries -------------------------------------------------------------

    def get(self, txn: Txn, key: bytes) -> Entry | None:
        raw = txn.get(key, db=self.chunks)
        return None if raw is None else Entry.decode(raw)

    def same_id(self, txn: Txn, chunk_id: bytes) -> Iterator[tuple[bytes, Entry]]:
        """Every domain's entry for this chunk id."""
        cur = txn.cursor(db=self.chunks)
        if not cur.set_range(chunk_id):
            return
        for key, raw in cur:
            if key[:16] != chunk_id:
                return
            yield key, Entry.decode(raw)

    def iter_entries(self, txn: Txn) -> Iterator[tuple[bytes, Entry]]:
        for key, raw in txn.cursor(db=self.chunks):
            yield key, Entry.decode(raw)

    # -- what garbage collection needs (chunkstore.gc) -----------------------

    def root_keys(self) -> set[bytes]:
        """Every chunk key some root names: the live set GC marks."""
        def fn(txn: Txn) -> set[bytes]:
            return set(txn.cursor(db=self.roots).iternext(keys=False, values=True))
        return self.read(fn)

    def sweep_page(self, after: bytes, live: set[bytes], cutoff: int,
                   limit: int) -> tuple[bytes | None, int, int]:
        """In one write transaction, look at up to `limit` entries whose key
        sorts after `after` and delete those not in `live` and not touched
        since `cutoff` (ms). Returns (last key seen or None at the end, seen,
        removed); call again with the last key to continue."""
        def fn(txn: Txn) -> tuple[bytes | None, int, int]:
            cur = txn.cursor(db=self.chunks)
            seen = 0
            last = None
            doomed = []
            if cur.set_range(after):
                for key, raw in cur:
                    if key == after:
                        continue
                    seen += 1
                    last = key
                    if key not in live and Entry.decode(raw).touched < cutoff:
                        doomed.append(key)
                    if seen >= limit:
                        break
            for key in doomed:
                txn.delete(key, db=self.chunks)
            return last, seen, len(doomed)
        return self.write(fn)

    def pack_usage(self) -> dict[PackId, dict[int, tuple[ChunkId, Entry]]]:
        """pack -> record offset -> (chunk id, entry) of every location an
        entry points at (one snapshot)."""
        def fn(txn: Txn) -> dict[PackId, dict[int, tuple[ChunkId, Entry]]]:
            usage: dict[PackId, dict[int, tuple[ChunkId, Entry]]] = defaultdict(dict)
            for key, entry in self.iter_entries(txn):
                usage[entry.pack].setdefault(entry.offset, (ChunkId(key[:16]), entry))
            return usage
        return self.read(fn)

    def repoint(self, pack: PackId, moves: dict[int, tuple[ChunkId, int]],
                new_pack: PackId) -> None:
        """In one write transaction, point every entry at (pack, offset) in
        `moves` to (new_pack, new offset). Scans each chunk id's entries (all
        entries sharing a location have its id), so an entry added since the
        caller planned the move is not missed."""
        def fn(txn: Txn) -> None:
            for off, (cid, new_off) in moves.items():
                for key, entry in list(self.same_id(txn, cid)):
                    if entry.location == (pack, off):
                        txn.put(key, entry.moved(new_pack, new_off).encode(), db=self.chunks)
        self.write(fn)

    def close(self) -> None:
        _open_indexes.discard(self)
        self.env.close()


def now_ms() -> int:
    return time.time_ns() // 1_000_000
