"""The chunk store: content-addressed chunks in packs, indexed by LMDB.

What it owns: putting and getting chunks (batched first), dedup, the codec,
read verification, roots for GC, integrity checks. What it does not: what a
chunk means (manifests live in composer/), where packs are kept (backends/).

Poisoning and trust domains
---------------------------
A chunk id is xxh3-128 of the plain bytes. xxh3 is fast and well-distributed
but not collision-resistant: someone who chooses chunk contents (an agent
whose sandbox we snapshot) can craft two different chunks with one id. If
dedup trusted the id alone, whichever chunk was stored first would be served
for both, so an agent could make a trusted image read its bytes.

Two rules close this:

1. Every index entry records the BLAKE3-256 digest of the plain bytes. A put
   whose id matches an entry is a dedup hit only if the BLAKE3 digests match
   too; otherwise it raises `ChunkCollision` and stores nothing. Finding two
   chunks equal in both xxh3-128 and BLAKE3-256 is infeasible, so a dedup hit
   never maps new content onto different stored bytes.
2. Entries are namespaced by trust domain: the key is (id, domain). Image
   builds write to `TRUSTED`; a snapshot writes to the domain its caller
   names (one per tenant, job or sandbox). A reader resolves ids in the
   domain its manifest belongs to. A crafted collision planted in an
   untrusted domain therefore cannot even deny service to a trusted put:
   the trusted put sees no entry under its own key. Across domains, a put
   reuses another domain's stored bytes (no second copy) only when the
   BLAKE3 digests match, i.e. only for identical content.

Cost, measured here on /usr data: BLAKE3 runs at 4.4 GB/s against xxh3's
21.6 GB/s and zstd-3's 0.28 GB/s, so the strong digest adds under 7 % to a
put of new data; reads do not pay it (they check xxh3; `verify` checks both).

Crash safety
------------
A put appends records to the writer's own pack, fsyncs it, and only then
commits the index entries in one LMDB transaction. A writer killed at any
point leaves at most unreferenced bytes at the end of a pack (reclaimed by
GC); no entry ever points at bytes that were not durable. Each process
writes its own pack (numbers come from the index), so processes never
interleave appends, and LMDB serialises the commits.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from . import ids as ids_module
from .backends import Backend, PackWriter, get_backend
from .codec import ChunkCodec, Codec, CodecError
from .config import StoreConfig
from .errors import (
    BackendError,
    ChunkCollision,
    ChunkCorrupt,
    ChunkNotFound,
    ChunkStoreError,
    ChunkTooLarge,
    PackNotFound,
    RootError,
    StoreFormatError,
    StoreReadOnly,
)
from .ids import TRUSTED, ChunkId, PackId, TrustDomain, strong_digest
from .index import Entry, Index, Txn, chunk_key, now_ms, split_key
from .pack import (
    MAX_CHUNK_SIZE,
    PACK_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    decode_record_header,
    encode_record_header,
)

T = TypeVar("T")
R = TypeVar("R")

_PARALLEL_MIN_BYTES = 1 << 20
_MAX_IOV = 512  # records per writev (2 iovecs each; IOV_MAX is 1024)


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    id: ChunkId
    domain: TrustDomain
    pack: PackId
    offset: int
    stored_len: int
    plain_len: int
    codec: Codec | int
    touched: int


@dataclass(frozen=True, slots=True)
class BadChunk:
    id: ChunkId
    domain: TrustDomain
    pack: PackId
    reason: str


@dataclass(slots=True)
class VerifyReport:
    checked: int = 0
    plain_bytes: int = 0
    bad: list[BadChunk] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad


@dataclass(frozen=True, slots=True)
class StoreStats:
    chunks: int
    plain_bytes: int
    stored_bytes: int
    packs: int
    pack_bytes: int
    roots: int


@dataclass(slots=True)
class PutCounters:
    """What this store object's puts did: chunks and plain bytes offered, and
    how many of them were new (the rest deduplicated). For progress reports."""

    chunks: int = 0
    plain_bytes: int = 0
    new_chunks: int = 0
    new_bytes: int = 0

    def add(self, ids: list[ChunkId], batch: list[bytes | memoryview],
            appended: dict[ChunkId, Entry]) -> None:
        self.chunks += len(ids)
        self.plain_bytes += sum(len(d) for d in batch)
        self.new_chunks += len(appended)
        self.new_bytes += sum(e.plain_len for e in appended.values())

    @property
    def dedup_ratio(self) -> float:
        return self.plain_bytes / self.new_bytes if self.new_bytes else float("inf")


class _Retry(Exception):
    """A decision made under a read transaction no longer holds (GC moved or
    removed an entry in between); plan the batch again."""


ProgressFn = Callable[[int], None]


class ChunkStore:
    """Open with `ChunkStore.open(path)`; use as a context manager or `close()`."""

    def __init__(self, root: Path, backend: Backend, index: Index, config: StoreConfig,
                 readonly: bool) -> None:
        self.root = root
        self.backend = backend
        self.index = index
        self.config = config
        self.readonly = readonly
        self.codec = ChunkCodec(config.zstd_level)
        self._pid = os.getpid()
        self._writer: PackWriter | None = None
        # packs filled during a put whose entries are not committed yet: they
        # stay locked (so GC leaves them alone) until the commit.
        self._retired: list[PackWriter] = []
        self._write_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self.counters = PutCounters()

    # -- opening -------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, config: StoreConfig | None = None,
             readonly: bool = False, create: bool = True) -> ChunkStore:
        """Open (and by default create) the store at `path`.

        A store on a read-only filesystem must be opened with readonly=True;
        asking for write access there raises StoreReadOnly at once rather
        than at the first put."""
        root = Path(path).absolute()
        config = config or StoreConfig()
        if not readonly:
            if not root.exists():
                if not create:
                    raise StoreFormatError(f"no chunk store at {root}")
                try:
                    root.mkdir(parents=True)
                except OSError as e:
                    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                        raise StoreReadOnly(root, str(e.strerror)) from e
                    raise
            if not os.access(root, os.W_OK):
                raise StoreReadOnly(root, "the directory is not writable; "
                                    "open with readonly=True to read it")
        if not (root / "index").is_dir() and (readonly or not create):
            raise StoreFormatError(f"{root} is not a chunk store (no index/)")
        backend = get_backend(root, readonly=readonly)
        index = Index(root / "index", readonly=readonly,
                      initial_map_size=config.initial_map_size, durable=config.durable)
        return cls(root, backend, index, config, readonly)

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if os.getpid() == self._pid:
                self.seal_writer()
        finally:
            if os.getpid() == self._pid:
                self.index.close()
            self.backend.close()
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def _check_process(self) -> None:
        """LMDB environments and our open pack do not survive fork: a child
        reopens both, and never appends to the parent's pack."""
        if self._closed:
            raise ValueError("chunk store is closed")
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._writer = None
            self._pool = None
            self._write_lock = threading.Lock()
            # py-lmdb refuses a second open of a path while the inherited
            # handle is registered; closing the child's copy is allowed.
            self.index.close()
            self.index = Index(self.index.path, readonly=self.readonly,
                               initial_map_size=self.config.initial_map_size,
                               durable=self.config.durable)
            self.backend = get_backend(self.root, readonly=self.readonly)

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreReadOnly(self.root, "opened read-only")

    # -- parallel helpers ----------------------------------------------------

    def _map(self, fn: Callable[[T], R], items: Sequence[T], nbytes: int) -> list[R]:
        """Map over items, in threads when the work is big enough to pay."""
        threads = self.config.threads
        if threads == 1 or len(items) < 2 or nbytes < _PARALLEL_MIN_BYTES:
            return [fn(x) for x in items]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                threads, thread_name_prefix="chunkstore")
        n = min(len(items), threads * 4)
        slices = [items[i::n] for i in range(n)]
        done = list(self._pool.map(lambda s: [fn(x) for x in s], slices))
        out: list[R] = [None] * len(items)  # type: ignore[list-item]
        for i, part in enumerate(done):
            out[i::n] = part
        return out

    # -- put -----------------------------------------------------------------

    def put(self, data: bytes | memoryview, domain: TrustDomain = TRUSTED) -> ChunkId:
        return self.put_many([data], domain)[0]

    def put_many(self, chunks: Iterable[bytes | memoryview],
                 domain: TrustDomain = TRUSTED) -> list[ChunkId]:
        """Store chunks, return their ids in order. Chunks already stored in
        `domain` (or, with an equal BLAKE3 digest, in another domain) are not
        written again. Commits in batches of `config.batch_bytes`."""
        self._check_process()
        self._check_writable()
        domain = TrustDomain(domain)
        out: list[ChunkId] = []
        batch: list[bytes | memoryview] = []
        size = 0
        for data in chunks:
            if not isinstance(data, bytes):
                # the caller may reuse its buffer before we hash it
                try:
                    data = memoryview(data).cast("B").tobytes()
                except TypeError as e:
                    raise TypeError(f"a chunk must be bytes-like, got {type(data).__name__}") from e
            if len(data) > MAX_CHUNK_SIZE:
                raise ChunkTooLarge(len(data), MAX_CHUNK_SIZE)
            batch.append(data)
            size += len(data)
            if size >= self.config.batch_bytes:
                out.extend(self._put_batch(batch, size, domain))
                batch, size = [], 0
        if batch:
            out.extend(self._put_batch(batch, size, domain))
        return out

    def _put_batch(self, batch: list[bytes | memoryview], nbytes: int,
                   domain: TrustDomain) -> list[ChunkId]:
        dnum = self.index.domain_number(domain, create=True)
        assert dnum is not None
        hashed = self._map(lambda d: (ChunkId.of(d), strong_digest(d)), batch, nbytes)
        ids = [h[0] for h in hashed]
        unique: dict[ChunkId, tuple[int, bytes]] = {}
        for i, (cid, strong) in enumerate(hashed):
            if cid in unique:
                if unique[cid][1] != strong:
                    raise ChunkCollision(cid, domain)
                continue
            unique[cid] = (i, strong)

        encoded: dict[ChunkId, tuple[Codec, bytes]] = {}
        for _ in range(5):
            plan = self.index.read(lambda txn: self._plan(txn, unique, dnum, domain))
            todo = [cid for cid, p in plan.items() if p is None and cid not in encoded]
            if todo:
                datas = [batch[unique[cid][0]] for cid in todo]
                encoded.update(zip(todo, self._map(self.codec.encode, datas,
                                                   sum(len(d) for d in datas))))
            # Appends, the index commit and the sealing of packs filled on the
            # way happen under one lock: a pack is never unlocked (visible to
            # GC as sealed) while it holds appends whose entries are not
            # committed. A retry re-appends; the bytes of the failed attempt
            # are garbage for GC.
            with self._write_lock:
                try:
                    new = [cid for cid, p in plan.items() if p is None]
                    appended = self._append(new, batch, unique, encoded)
                    self.index.write(lambda txn, plan=plan, appended=appended: self._commit(  # type: ignore[misc]
                        txn, plan, unique, appended, dnum, domain))
                except _Retry:
                    continue
                finally:
                    self._close_retired()
            self.counters.add(ids, batch, appended)
            return ids
        raise ChunkStoreError(f"put of {len(unique)} chunks kept racing with garbage "
                              "collection; giving up after 5 attempts")

    def _plan(self, txn: Txn, unique: dict[ChunkId, tuple[int, bytes]],
              dnum: int, domain: TrustDomain) -> dict[ChunkId, bytes | None]:
        """For each id: the key of an entry whose bytes it can share, or None
        when its bytes must be written."""
        plan: dict[ChunkId, bytes | None] = {}
        for cid, (_, strong) in unique.items():
            key = chunk_key(cid, dnum)
            entry = self.index.get(txn, key)
            if entry is not None:
                if entry.strong != strong:
                    raise ChunkCollision(cid, domain)
                plan[cid] = key
                continue
            plan[cid] = None
            for other_key, other in self.index.same_id(txn, cid):
                if other.strong == strong:
                    plan[cid] = other_key
                    break
        return plan

    def _append(self, todo: list[ChunkId], batch: list[bytes | memoryview],
                unique: dict[ChunkId, tuple[int, bytes]],
                encoded: dict[ChunkId, tuple[Codec, bytes]]) -> dict[ChunkId, Entry]:
        """Append records to the current pack (rolling as needed) and sync.
        Caller holds _write_lock."""
        now = now_ms()
        placed: dict[ChunkId, Entry] = {}
        if not todo:
            return placed
        if True:
            pending: list[tuple[ChunkId, int, Codec, bytes]] = []
            pending_size = 0

            def flush() -> None:
                nonlocal pending, pending_size
                if not pending:
                    return
                writer = self._current_writer()
                for start in range(0, len(pending), _MAX_IOV):
                    group = pending[start:start + _MAX_IOV]
                    parts: list[bytes] = []
                    for cid, plain_len, codec, stored in group:
                        parts.append(encode_record_header(cid, codec, plain_len, len(stored)))
                        parts.append(stored)
                    offset = writer.append(parts)
                    for cid, plain_len, codec, stored in group:
                        offset += RECORD_HEADER_SIZE
                        placed[cid] = Entry(writer.pack, offset, len(stored), plain_len,
                                            int(codec), now, unique[cid][1])
                        offset += len(stored)
                pending, pending_size = [], 0

            for cid in todo:
                data = batch[unique[cid][0]]
                codec, stored = encoded[cid]
                rec = RECORD_HEADER_SIZE + len(stored)
                writer = self._current_writer()
                if writer.size + pending_size + rec > self.config.pack_size \
                        and writer.size + pending_size > PACK_HEADER_SIZE:
                    flush()
                    self._retire_writer()
                pending.append((cid, len(data), codec, stored))
                pending_size += rec
            flush()
            if self._writer is not None and (self.config.durable or self._retired):
                self._writer.sync()
        return placed

    def _current_writer(self) -> PackWriter:
        if self._writer is None:
            self._writer = self.backend.create_pack(self.index.allocate_pack())
        return self._writer

    def _retire_writer(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.sync()
            self._retired.append(writer)

    def _close_retired(self) -> None:
        """Caller holds _write_lock."""
        retired, self._retired = self._retired, []
        for writer in retired:
            writer.close()

    def seal_writer(self) -> None:
        """Close this store's open pack writer (synced if durable), so the
        pack it was appending to is sealed and the next put starts a new one.
        Garbage collection calls it first: a pack this process still appends
        to is never a repack candidate, and sealing it lets its dead tail be
        reclaimed."""
        with self._write_lock:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                try:
                    if self.config.durable:
                        writer.sync()
                finally:
                    writer.close()

    def _commit(self, txn: Txn, plan: dict[ChunkId, bytes | None],
                unique: dict[ChunkId, tuple[int, bytes]], appended: dict[ChunkId, Entry],
                dnum: int, domain: TrustDomain) -> None:
        now = now_ms()
        db = self.index.chunks
        for cid, source in plan.items():
            strong = unique[cid][1]
            key = chunk_key(cid, dnum)
            current = self.index.get(txn, key)
            if current is not None:
                # already ours (planned hit, or another writer got there first)
                if current.strong != strong:
                    raise ChunkCollision(cid, domain)
                if current.touched < now:
                    txn.put(key, current.touched_at(now).encode(), db=db)
                continue
            if source is not None and source != key:
                other = self.index.get(txn, source)
                if other is not None and other.strong == strong:
                    txn.put(key, other.touched_at(now).encode(), db=db)
                    continue
            if cid in appended:
                txn.put(key, appended[cid].encode(), db=db)
                continue
            raise _Retry()

    # -- get -----------------------------------------------------------------

    def get(self, chunk_id: ChunkId, domain: TrustDomain = TRUSTED) -> bytes:
        """One chunk. A direct path (one lookup, one pread) for the common
        case; anything unusual (GC moved it, corruption) goes through
        get_many, which retries or raises the typed error."""
        self._check_process()
        dnum = self.index.domain_number(domain, create=False)
        if dnum is None:
            raise ChunkNotFound(chunk_id, domain)
        key = chunk_key(chunk_id, dnum)
        entry = self.index.read(lambda txn: self.index.get(txn, key))
        if entry is None:
            raise ChunkNotFound(chunk_id, domain)
        if self._implausible(chunk_id, entry) is not None:
            return self.get_many([chunk_id], domain)[0]
        try:
            raw = self.backend.read_range(entry.pack, entry.offset - RECORD_HEADER_SIZE,
                                          entry.stored_len + RECORD_HEADER_SIZE)
        except PackNotFound:
            return self.get_many([chunk_id], domain)[0]
        result = self.check_record(chunk_id, entry, raw)
        if isinstance(result, Exception):
            return self.get_many([chunk_id], domain)[0]
        return result

    def get_many(self, ids: Sequence[ChunkId], domain: TrustDomain = TRUSTED) -> list[bytes]:
        """The plain bytes of each chunk, in order. Every chunk returned has
        been checked against its id; a chunk that fails raises ChunkCorrupt."""
        self._check_process()
        if not ids:
            return []
        domain = TrustDomain(domain)
        dnum = self.index.domain_number(domain, create=False)
        if dnum is None:
            raise ChunkNotFound(ids[0], domain)
        wanted = list(dict.fromkeys(ids))
        found = self._lookup(wanted, dnum, domain)
        data = self._read_entries(found, dnum, domain)
        return [data[cid] for cid in ids]

    def _lookup(self, ids: Sequence[ChunkId], dnum: int,
                domain: TrustDomain) -> dict[ChunkId, Entry]:
        def fn(txn: Txn) -> dict[ChunkId, Entry]:
            out = {}
            for cid in ids:
                entry = self.index.get(txn, chunk_key(cid, dnum))
                if entry is None:
                    raise ChunkNotFound(cid, domain)
                out[cid] = entry
            return out
        return self.index.read(fn)

    def _read_entries(self, entries: dict[ChunkId, Entry], dnum: int,
                      domain: TrustDomain) -> dict[ChunkId, bytes]:
        out: dict[ChunkId, bytes] = {}
        todo = entries
        for attempt in range(3):
            failed: dict[ChunkId, Exception] = {}
            by_pack: dict[PackId, list[tuple[ChunkId, Entry]]] = defaultdict(list)
            for cid, entry in todo.items():
                bad = self._implausible(cid, entry)
                if bad is not None:
                    failed[cid] = bad
                else:
                    by_pack[entry.pack].append((cid, entry))
            raws: list[tuple[ChunkId, Entry, bytes]] = []
            for pack, items in by_pack.items():
                try:
                    got = self.backend.read_ranges(
                        pack, [(e.offset - RECORD_HEADER_SIZE, e.stored_len + RECORD_HEADER_SIZE)
                               for _, e in items])
                except PackNotFound:
                    for cid, e in items:
                        failed[cid] = self._corrupt(cid, e, "its pack does not exist")
                    continue
                raws.extend((cid, e, raw) for (cid, e), raw in zip(items, got))
            nbytes = sum(e.plain_len for _, e, _ in raws)
            decoded = self._map(lambda r: self.check_record(*r), raws, nbytes)
            for (cid, _, _), result in zip(raws, decoded):
                if isinstance(result, Exception):
                    failed[cid] = result
                else:
                    out[cid] = result
            if not failed:
                return out
            # GC may have moved these chunks since we looked them up: look
            # again, and retry the ones whose location changed.
            fresh = self._lookup(list(failed), dnum, domain)
            todo = {cid: e for cid, e in fresh.items() if e.location != todo[cid].location}
            if len(todo) < len(failed) or attempt == 2:
                first = next(cid for cid in failed if cid not in todo) if len(todo) < len(
                    failed) else next(iter(failed))
                raise failed[first]
        raise AssertionError("unreachable")

    def locate_many(self, ids: Sequence[ChunkId], domain: TrustDomain = TRUSTED
                    ) -> dict[ChunkId, Entry]:
        """Where each chunk's record is (its index entry: pack, offset of the
        stored bytes, lengths, codec), for the chunks the store has; the
        others are left out. A location is a hint: GC may move the record
        later (a reader checks the record header and looks again)."""
        self._check_process()
        dnum = self.index.domain_number(TrustDomain(domain), create=False)
        if dnum is None:
            return {}

        def fn(txn: Txn) -> dict[ChunkId, Entry]:
            out = {}
            for cid in ids:
                entry = self.index.get(txn, chunk_key(cid, dnum))
                if entry is not None:
                    out[cid] = entry
            return out
        return self.index.read(fn)

    def strong_many(self, ids: Sequence[ChunkId], domain: TrustDomain = TRUSTED
                    ) -> list[bytes]:
        """The BLAKE3-256 digest recorded for each chunk (ChunkNotFound if absent)."""
        found = self._entries(ids, domain)
        return [found[c].strong for c in ids]

    def _entries(self, ids: Sequence[ChunkId], domain: TrustDomain) -> dict[ChunkId, Entry]:
        """The index entry of each chunk (ChunkNotFound for the first missing one)."""
        self._check_process()
        domain = TrustDomain(domain)
        dnum = self.index.domain_number(domain, create=False)
        if dnum is None:
            raise ChunkNotFound(ids[0], domain) if ids else ChunkNotFound("-", domain)
        return self._lookup(list(dict.fromkeys(ids)), dnum, domain)

    def raw_records(self, ids: Sequence[ChunkId], domain: TrustDomain = TRUSTED
                    ) -> list[tuple[bytes, int, int, int]]:
        """Each chunk's stored record as it sits in its pack (record header +
        stored bytes), checked like get_many checks it, with (stored_len,
        plain_len, codec): what a push copies into cluster packs without
        recompressing."""
        found = self._entries(ids, domain)
        by_pack: dict[PackId, list[ChunkId]] = defaultdict(list)
        for cid, e in found.items():
            by_pack[e.pack].append(cid)
        raws: dict[ChunkId, bytes] = {}
        for pack, cids in by_pack.items():
            got = self.backend.read_ranges(
                pack, [(found[c].offset - RECORD_HEADER_SIZE,
                        found[c].stored_len + RECORD_HEADER_SIZE) for c in cids])
            for cid, raw in zip(cids, got, strict=True):
                result = self.check_record(cid, found[cid], raw)
                if isinstance(result, Exception):
                    raise result
                raws[cid] = raw
        return [(raws[c], found[c].stored_len, found[c].plain_len, found[c].codec)
                for c in ids]

    def _implausible(self, cid: ChunkId, entry: Entry) -> ChunkCorrupt | None:
        """An index entry that cannot describe a record (damaged index)."""
        if entry.offset < PACK_HEADER_SIZE + RECORD_HEADER_SIZE or entry.offset > 1 << 48:
            return self._corrupt(cid, entry, f"index offset {entry.offset} is impossible")
        if entry.plain_len > MAX_CHUNK_SIZE or entry.stored_len > MAX_CHUNK_SIZE + (1 << 20):
            return self._corrupt(cid, entry, f"index lengths are impossible "
                                 f"(plain {entry.plain_len}, stored {entry.stored_len})")
        return None

    def check_record(self, cid: ChunkId, entry: Entry, raw: bytes) -> bytes | ChunkCorrupt:
        """Check a stored record (`raw`: its header and stored bytes, as read
        from the pack at entry.offset - RECORD_HEADER_SIZE) against its index
        entry and return the plain bytes, or the ChunkCorrupt error describing
        what is wrong (returned, not raised: readers of many records, and GC
        before it copies a record, collect them)."""
        if len(raw) < RECORD_HEADER_SIZE + entry.stored_len:
            return self._corrupt(cid, entry, f"truncated: pack ends "
                                 f"{RECORD_HEADER_SIZE + entry.stored_len - len(raw)} bytes "
                                 f"short of offset {entry.offset + entry.stored_len}")
        header = decode_record_header(raw)
        if header is None:
            return self._corrupt(cid, entry, f"no record header at offset {entry.offset}")
        if header.chunk_id != cid:
            return self._corrupt(cid, entry, f"record at offset {entry.offset} holds chunk "
                                 f"{header.chunk_id.hex()}")
        if (header.codec, header.plain_len, header.stored_len) != (
                entry.codec, entry.plain_len, entry.stored_len):
            return self._corrupt(cid, entry, "record header and index disagree "
                                 f"(codec {header.codec}/{entry.codec}, "
                                 f"plain {header.plain_len}/{entry.plain_len}, "
                                 f"stored {header.stored_len}/{entry.stored_len})")
        try:
            plain = self.codec.decode(entry.codec, memoryview(raw)[RECORD_HEADER_SIZE:],
                                      entry.plain_len)
        except CodecError as e:
            return self._corrupt(cid, entry, str(e))
        if ids_module.id_digest(plain) != cid:
            return self._corrupt(cid, entry, "content does not match its id (xxh3)")
        return plain

    @staticmethod
    def _corrupt(cid: ChunkId, entry: Entry, reason: str) -> ChunkCorrupt:
        return ChunkCorrupt(cid, f"{entry.pack:016x}", reason)

    # -- queries -------------------------------------------------------------

    def has(self, chunk_id: ChunkId, domain: TrustDomain = TRUSTED) -> bool:
        return self.has_many([chunk_id], domain)[0]

    def has_many(self, ids: Sequence[ChunkId], domain: TrustDomain = TRUSTED) -> list[bool]:
        self._check_process()
        dnum = self.index.domain_number(TrustDomain(domain), create=False)
        if dnum is None:
            return [False] * len(ids)
        return self.index.read(
            lambda txn: [txn.get(chunk_key(c, dnum), db=self.index.chunks) is not None
                         for c in ids])

    def packs_open(self, ids: Sequence[ChunkId], domain: TrustDomain = TRUSTED) -> bool:
        """Whether every chunk is stored in a pack the backend holds open, so
        reading them opens nothing (opening is where a read of a local store
        can block: a pack on a hung mount, a FIFO in its place). False for a
        chunk the store does not have."""
        dnum = self.index.domain_number(TrustDomain(domain), create=False)
        if dnum is None:
            return False

        def packs(txn: Txn) -> set[PackId] | None:
            out = set()
            for cid in ids:
                entry = self.index.get(txn, chunk_key(cid, dnum))
                if entry is None:
                    return None
                out.add(entry.pack)
            return out
        found = self.index.read(packs)
        return found is not None and all(self.backend.is_open(p) for p in found)

    def stat(self, chunk_id: ChunkId, domain: TrustDomain = TRUSTED) -> ChunkInfo:
        self._check_process()
        domain = TrustDomain(domain)
        dnum = self.index.domain_number(domain, create=False)
        if dnum is None:
            raise ChunkNotFound(chunk_id, domain)
        entry = self._lookup([chunk_id], dnum, domain)[chunk_id]
        return self._info(chunk_id, domain, entry)

    def _info(self, cid: ChunkId, domain: TrustDomain, e: Entry) -> ChunkInfo:
        try:
            codec: Codec | int = Codec(e.codec)
        except ValueError:
            codec = e.codec
        return ChunkInfo(cid, domain, e.pack, e.offset, e.stored_len, e.plain_len,
                         codec, e.touched)

    def iter_chunks(self, domain: TrustDomain | None = None,
                    page: int = 10_000) -> Iterator[ChunkInfo]:
        """Every chunk (of one domain, or all), in id order. Pages through the
        index in short read transactions so a long iteration holds no snapshot."""
        self._check_process()
        dnum = None if domain is None else self.index.domain_number(domain, create=False)
        if domain is not None and dnum is None:
            return
        after = b""
        while True:
            def fn(txn: Txn, after: bytes = after) -> list[tuple[bytes, Entry]]:
                cur = txn.cursor(db=self.index.chunks)
                rows: list[tuple[bytes, Entry]] = []
                if not cur.set_range(after):
                    return rows
                for key, raw in cur:
                    if key == after:
                        continue
                    rows.append((key, Entry.decode(raw)))
                    if len(rows) >= page:
                        break
                return rows
            rows = self.index.read(fn)
            if not rows:
                return
            for key, entry in rows:
                cid, num = split_key(key)
                if dnum is None or num == dnum:
                    yield self._info(cid, self.index.domain_name(num), entry)
            after = rows[-1][0]

    def stats(self) -> StoreStats:
        self._check_process()

        def fn(txn: Txn) -> tuple[int, int, int, int]:
            chunks = plain = stored = 0
            seen: set[tuple[int, int]] = set()
            for _, e in self.index.iter_entries(txn):
                chunks += 1
                plain += e.plain_len
                if e.location not in seen:
                    seen.add(e.location)
                    stored += e.stored_len
            roots = sum(1 for _ in txn.cursor(db=self.index.roots).iternext_nodup())
            return chunks, plain, stored, roots
        chunks, plain, stored, roots = self.index.read(fn)
        packs = list(self.backend.iter_packs())
        return StoreStats(chunks, plain, stored, len(packs), sum(s for _, s in packs), roots)

    # -- verify --------------------------------------------------------------

    def verify(self, progress: ProgressFn | None = None) -> VerifyReport:
        """Re-read every chunk, check record header, codec, xxh3 and BLAKE3.
        Reports every bad chunk (it does not stop at the first)."""
        self._check_process()
        report = VerifyReport()
        by_pack: dict[PackId, list[tuple[ChunkId, int, Entry]]] = defaultdict(list)

        def listing(txn: Txn) -> list[tuple[bytes, Entry]]:
            return list(self.index.iter_entries(txn))
        for key, e in self.index.read(listing):
            cid, num = split_key(key)
            by_pack[e.pack].append((cid, num, e))
        for pack, items in sorted(by_pack.items()):
            items.sort(key=lambda x: x[2].offset)
            for start in range(0, len(items), 256):
                group = []
                for cid, num, e in items[start:start + 256]:
                    bad = self._implausible(cid, e)
                    if bad is None:
                        group.append((cid, num, e))
                    else:
                        report.checked += 1
                        report.bad.append(BadChunk(cid, self.index.domain_name(num), pack,
                                                   bad.reason))
                try:
                    raws = self.backend.read_ranges(
                        pack, [(e.offset - RECORD_HEADER_SIZE, e.stored_len + RECORD_HEADER_SIZE)
                               for _, _, e in group])
                except BackendError as err:
                    for cid, num, _ in group:
                        report.bad.append(BadChunk(cid, self.index.domain_name(num), pack,
                                                   str(err)))
                    continue

                def check(args: tuple[tuple[ChunkId, int, Entry], bytes]) -> str | None:
                    (cid, _, e), raw = args
                    result = self.check_record(cid, e, raw)
                    if isinstance(result, Exception):
                        return getattr(result, "reason", str(result))
                    if strong_digest(result) != e.strong:
                        return "content does not match its BLAKE3 digest"
                    return None

                pairs = list(zip(group, raws))
                results = self._map(check, pairs, sum(e.plain_len for _, _, e in group))
                for (cid, num, e), reason in zip(group, results):
                    report.checked += 1
                    report.plain_bytes += e.plain_len
                    if reason is not None:
                        report.bad.append(BadChunk(cid, self.index.domain_name(num), pack,
                                                   reason))
                if progress is not None:
                    progress(sum(e.plain_len for _, _, e in group))
        # a concurrent GC may have moved (or swept) what we listed
        report.bad = [b for b in report.bad if not self._fine_now(b)]
        return report

    def _fine_now(self, bad: BadChunk) -> bool:
        dnum = self.index.domain_number(bad.domain, create=False)
        if dnum is None:
            return False
        key = chunk_key(bad.id, dnum)
        entry = self.index.read(lambda txn: self.index.get(txn, key))
        if entry is None:
            return True  # swept meanwhile: nothing left to be bad
        if entry.pack == bad.pack:
            return False
        try:
            data = self.get_many([bad.id], bad.domain)[0]
        except ChunkStoreError:
            return False
        return strong_digest(data) == entry.strong

    # -- roots ---------------------------------------------------------------

    def set_root(self, name: str, ids: Iterable[ChunkId],
                 domain: TrustDomain = TRUSTED) -> int:
        """Make `name` a GC root holding exactly `ids` (replacing what it held).
        Every id must be stored in `domain`; returns how many distinct chunks
        the root holds. Naming a chunk in a root also refreshes it, so a GC
        that already marked cannot sweep it."""
        self._check_process()
        self._check_writable()
        if not name:
            raise RootError("a root needs a name")
        domain = TrustDomain(domain)
        dnum = self.index.domain_number(domain, create=True)
        assert dnum is not None
        keys = sorted({chunk_key(c, dnum) for c in ids})
        rname = name.encode()

        def fn(txn: Txn) -> int:
            now = now_ms()
            txn.delete(rname, db=self.index.roots)  # all its values
            for key in keys:
                entry = self.index.get(txn, key)
                if entry is None:
                    raise RootError(f"root {name!r} names chunk {key[:16].hex()} which is "
                                    f"not stored in trust domain {domain}")
                if entry.touched < now:
                    txn.put(key, entry.touched_at(now).encode(), db=self.index.chunks)
                txn.put(rname, key, db=self.index.roots, dupdata=True)
            return len(keys)
        return self.index.write(fn)

    def remove_root(self, name: str) -> bool:
        self._check_process()
        self._check_writable()
        return bool(self.index.write(lambda txn: txn.delete(name.encode(),
                                                            db=self.index.roots)))

    def roots(self) -> list[str]:
        self._check_process()

        def fn(txn: Txn) -> list[str]:
            return [bytes(k).decode()
                    for k in txn.cursor(db=self.index.roots).iternext_nodup(values=False)]
        return self.index.read(fn)

    def root_ids(self, name: str) -> list[tuple[ChunkId, TrustDomain]]:
        self._check_process()

        def fn(txn: Txn) -> list[bytes]:
            cur = txn.cursor(db=self.index.roots)
            if not cur.set_key(name.encode()):
                raise RootError(f"no root named {name!r}")
            return list(cur.iternext_dup())
        out = []
        for key in self.index.read(fn):
            cid, num = split_key(key)
            out.append((cid, self.index.domain_name(num)))
        return out

    # -- gc ------------------------------------------------------------------

    def gc(self, *, grace_seconds: float = 3600, repack_threshold: float = 0.5,
           progress: ProgressFn | None = None) -> Any:
        """Mark from roots, sweep unreferenced chunks older than the grace
        period, repack sparse packs. See chunkstore.gc."""
        from .gc import collect
        self._check_process()
        self._check_writable()
        return collect(self, grace_seconds=grace_seconds, repack_threshold=repack_threshold,
                       progress=progress)
