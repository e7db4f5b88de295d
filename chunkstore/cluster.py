"""The cluster chunk store: packs and per-layer location tables in a shared
object store (SeaweedFS/S3, or a POSIX mount every node sees), and ranged
reads of chunks through them.

Layout under the store's root (bucket/prefix or directory):

    packs/<blake3>.pack        pack objects (the chunk store's pack format:
                               header + self-describing records), named by
                               the BLAKE3 of their bytes, so packs from any
                               number of converters never collide
    layers/<digest key>.loc    a layer's location table: for every chunk the
                               layer needs (its manifest's chunks and its file
                               data), the pack and byte range holding it

The same store also holds the image catalog (image records and tags), which
is the image model's and lives in `composer.remote`; this module knows layers
only as digests with a list of chunks, never images or tags.

Writers (`push_layer`) upload packs first, then the location table, each as
one atomic object put: a reader never sees a table pointing at bytes that
are not there. (The image record and tag follow, written by composer.)

Readers never look a chunk up remotely: when a layer is mounted, its
location table (~44 bytes per chunk, zstd-compressed; a 1 GB image at 256 KiB
chunks has ~4,000 rows, 180 KB) is fetched once and kept in memory, and every
chunk read is a ranged GET of just its record, coalesced with its neighbours
in the same pack, in parallel with a bound, with timeouts and retries. A
node holding 1,000 layers of 4,000 chunks holds 4 M rows, ~300 MB as Python
objects today (a sorted array per table would be ~180 MB; the next step).
Records are checked exactly as the local store checks them (header, codec,
xxh3 of the plain bytes against the id): a corrupted object is detected on
read and never served.

Dedup across converters: a push loads the location tables already in the
cluster and uploads only chunks none of them has; two converters pushing at
the same moment may both upload a chunk new to both (stored twice, never
wrong), which the next push of either no longer does.

Garbage: `collect` deletes the tables of layers the caller no longer keeps
and packs no kept table names (composer decides which layers are kept: those
of tagged images).
"""

from __future__ import annotations

import logging
import re
import struct
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack
import zstandard

from .codec import ChunkCodec, CodecError
from .digests import Digest, digest_key
from .errors import BadDigest, ChunkCollision, ChunkCorrupt, ChunkNotFound
from .ids import TRUSTED, ChunkId, TrustDomain, id_digest
from .objects import ObjectNotFound, ObjectStore
from .pack import MAX_CHUNK_SIZE, PACK_HEADER, RECORD_HEADER_SIZE, decode_record_header

if TYPE_CHECKING:
    from .store import ChunkStore

log = logging.getLogger(__name__)

LOC_VERSION = 2
# id, pack index, offset of the record, stored, plain, codec, BLAKE3 of the plain bytes
_ROW = struct.Struct(">16sIQIIB32s")
MAX_TABLE = 256 << 20  # decoded bytes of one location table (~3.5 M rows)
_PACK_NAME = re.compile(r"^[0-9a-f]{64}\.pack$")
PACK_TARGET = 64 << 20
COALESCE_GAP = 64 << 10
COALESCE_MAX = 8 << 20


def layer_key(digest: str) -> str:
    """The object key of a layer's location table."""
    return f"layers/{digest_key(digest)}.loc"


def pack_key(name: str) -> str:
    """The object key of a pack (`name` is `<blake3 hex>.pack`)."""
    return f"packs/{name}"


@dataclass(frozen=True, slots=True)
class Loc:
    pack: str  # object key
    offset: int  # of the record header
    stored_len: int
    plain_len: int
    codec: int
    strong: bytes  # BLAKE3-256 of the plain bytes (the collision check behind dedup)


@dataclass
class LocTable:
    domain: TrustDomain
    manifest: list[ChunkId]
    locs: dict[ChunkId, Loc]

    def encode(self) -> bytes:
        packs = sorted({loc.pack for loc in self.locs.values()})
        index = {p: i for i, p in enumerate(packs)}
        rows = b"".join(_ROW.pack(bytes(cid), index[loc.pack], loc.offset, loc.stored_len,
                                  loc.plain_len, loc.codec, loc.strong)
                        for cid, loc in self.locs.items())
        body = msgpack.packb({"v": LOC_VERSION, "domain": str(self.domain),
                              "manifest": [bytes(c) for c in self.manifest],
                              "packs": packs, "rows": rows}, use_bin_type=True)
        return zstandard.ZstdCompressor(level=9).compress(body)

    @classmethod
    def decode(cls, raw: bytes, where: str) -> LocTable:
        """Parse a table from the store: bounded, and every field checked (a
        table may come from anywhere)."""
        try:
            body = zstandard.ZstdDecompressor().decompressobj().decompress(raw[:MAX_TABLE])
            if len(body) >= MAX_TABLE:
                raise ValueError(f"decodes to more than {MAX_TABLE} bytes")
            doc = msgpack.unpackb(body, raw=False)
            if not isinstance(doc, dict) or doc.get("v") != LOC_VERSION:
                raise ValueError(f"not a version {LOC_VERSION} table")
            packs = [str(p) for p in doc["packs"]]
            if not all(_PACK_NAME.match(p) for p in packs):
                raise ValueError("bad pack name")
            rows = doc["rows"]
            if not isinstance(rows, bytes) or len(rows) % _ROW.size:
                raise ValueError("row table is truncated")
            locs = {}
            for off in range(0, len(rows), _ROW.size):
                cid, p, o, st, n, c, h = _ROW.unpack_from(rows, off)
                if st > MAX_CHUNK_SIZE + (1 << 20) or n > MAX_CHUNK_SIZE:
                    raise ValueError(f"impossible chunk lengths {st}/{n}")
                locs[ChunkId(cid)] = Loc(packs[p], o, st, n, c, h)
            return cls(TrustDomain(str(doc["domain"])),
                       [ChunkId(bytes(c)) for c in doc["manifest"]], locs)
        except Exception as e:  # any malformed input is a corrupt table, nothing else
            raise ChunkCorrupt("-", where, f"location table cannot be decoded: {e}") from e


@dataclass
class ReadStats:
    requests: int = 0
    bytes_read: int = 0
    chunks: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class ClusterReader:
    """Reads chunks of registered layers from the object store: the source
    the node cache fetches misses from."""

    def __init__(self, objects: ObjectStore, *, parallel: int = 8) -> None:
        self.objects = objects
        self.codec = ChunkCodec()
        self.stats = ReadStats()
        self._locs: dict[tuple[str, bytes], Loc] = {}
        self._mu = threading.Lock()
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="cluster-read")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def register(self, table: LocTable, where: str = "-") -> None:
        """Make a layer's chunks readable. A table that names a chunk id the
        node already knows with different content (another BLAKE3) is refused:
        an xxh3 collision must not let one image's chunks replace another's."""
        d = str(table.domain)
        with self._mu:
            for cid, loc in table.locs.items():
                old = self._locs.get((d, bytes(cid)))
                if old is not None and old.strong != loc.strong:
                    raise ChunkCollision(cid, d)
            for cid, loc in table.locs.items():
                self._locs.setdefault((d, bytes(cid)), loc)

    def get_many(self, ids: Sequence[ChunkId], domain: TrustDomain = TRUSTED) -> list[bytes]:
        d = str(domain)
        wanted = list(dict.fromkeys(ids))
        with self._mu:
            locs = {}
            for cid in wanted:
                loc = self._locs.get((d, bytes(cid)))
                if loc is None:
                    raise ChunkNotFound(cid, domain)
                locs[cid] = loc
        by_pack: dict[str, list[tuple[ChunkId, Loc]]] = defaultdict(list)
        for cid, loc in locs.items():
            by_pack[loc.pack].append((cid, loc))
        jobs = []
        for pack, items in by_pack.items():
            items.sort(key=lambda x: x[1].offset)
            run: list[tuple[ChunkId, Loc]] = []
            for item in items:
                if run:
                    start = run[0][1].offset
                    end = run[-1][1].offset + RECORD_HEADER_SIZE + run[-1][1].stored_len
                    loc = item[1]
                    if (loc.offset - end > COALESCE_GAP or
                            loc.offset + RECORD_HEADER_SIZE + loc.stored_len - start > COALESCE_MAX):
                        jobs.append((pack, run))
                        run = []
                run.append(item)
            if run:
                jobs.append((pack, run))
        if len(jobs) == 1:  # (most reads: one GET, in this thread, no hand-off)
            results = self._read_run(*jobs[0])
            return [results[c] for c in ids]
        results = {}
        futures = [self._pool.submit(self._read_run, pack, run) for pack, run in jobs]
        first: BaseException | None = None
        for fut in futures:
            try:
                results.update(fut.result())
            except BaseException as e:  # noqa: BLE001 - the first error is raised below
                first = first or e
        if first is not None:
            raise first
        return [results[c] for c in ids]

    def _read_run(self, pack: str, run: list[tuple[ChunkId, Loc]]) -> dict[ChunkId, bytes]:
        start = run[0][1].offset
        end = max(loc.offset + RECORD_HEADER_SIZE + loc.stored_len for _, loc in run)
        buf = memoryview(self.objects.get_range(pack_key(pack), start, end - start))
        with self.stats.lock:
            self.stats.requests += 1
            self.stats.bytes_read += len(buf)
            self.stats.chunks += len(run)
        out = {}
        for cid, loc in run:
            rel = loc.offset - start
            out[cid] = decode_record(cid, buf[rel:rel + RECORD_HEADER_SIZE + loc.stored_len],
                                     loc, self.codec)
        return out


def decode_record(cid: ChunkId, raw: memoryview | bytes, loc: Loc, codec: ChunkCodec) -> bytes:
    """The plain bytes of one record, checked like the local store checks them."""
    def bad(reason: str) -> ChunkCorrupt:
        return ChunkCorrupt(cid, loc.pack, reason)
    if len(raw) < RECORD_HEADER_SIZE + loc.stored_len:
        raise bad(f"truncated at offset {loc.offset}")
    header = decode_record_header(raw)
    if header is None or header.chunk_id != cid:
        raise bad(f"no record of this chunk at offset {loc.offset}")
    if (header.codec, header.plain_len, header.stored_len) != (
            loc.codec, loc.plain_len, loc.stored_len):
        raise bad("record header and location table disagree")
    try:
        plain = codec.decode(loc.codec, raw[RECORD_HEADER_SIZE:], loc.plain_len)
    except CodecError as e:
        raise bad(str(e)) from e
    if id_digest(plain) != cid:
        raise bad("content does not match its id (xxh3)")
    return plain


@dataclass
class TableGcReport:
    """What `Cluster.collect` deleted."""

    tables: int = 0
    packs: int = 0
    bytes_freed: int = 0


@dataclass
class LayerPush:
    """What pushing one layer's chunks and table did."""

    chunks_uploaded: int = 0
    chunks_deduped: int = 0
    bytes_uploaded: int = 0
    packs: int = 0


# (trust domain, chunk id bytes) -> where the cluster holds that chunk
KnownLocations = dict[tuple[str, bytes], Loc]


class Cluster:
    """Chunk data and layer location tables in an object store."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self.reader = ClusterReader(objects)
        self._tables: dict[str, LocTable] = {}

    def close(self) -> None:
        self.reader.close()
        self.objects.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading (what the node daemon needs) -----------------------------------

    def table(self, digest: str, *, register: bool = True) -> LocTable:
        t = self._tables.get(digest)
        if t is None:
            raw = self.objects.get(layer_key(digest))
            t = LocTable.decode(raw, layer_key(digest))
            if not register:
                return t
            self.reader.register(t, layer_key(digest))
            self._tables[digest] = t
        return t

    def has_layer(self, digest: str) -> bool:
        return digest in self._tables or self.objects.exists(layer_key(digest))

    def list_layers(self) -> list[str]:
        out = []
        for key in self.objects.list("layers/"):
            digest = _digest_in(key, "layers/", ".loc")
            if digest is not None:
                out.append(digest)
        return out

    def load_manifest_bytes(self, digest: str) -> tuple[bytes, TrustDomain]:
        t = self.table(digest)
        raw = b"".join(self.reader.get_many(t.manifest, t.domain))
        if not Digest.parse(digest).matches(raw):
            raise ChunkCorrupt("-", layer_key(digest), "manifest does not match its digest")
        return raw, t.domain

    # -- writing (what a converter does after a local conversion) --------------

    def known_locations(self) -> KnownLocations:
        """Every chunk location the cluster's layers name (for dedup on push)."""
        out: KnownLocations = {}
        for digest in self.list_layers():
            try:
                t = self.table(digest, register=False)  # push does not read through them
            except (ObjectNotFound, ChunkCorrupt) as e:
                log.warning("push: location table of %s skipped: %s", digest, e)
                continue
            for cid, loc in t.locs.items():
                out[(str(t.domain), bytes(cid))] = loc
        return out

    def reuse_layer(self, digest: str) -> bool:
        """Whether the cluster has layer `digest`'s table; if so, touch it and
        its packs, so a concurrent `collect` keeps them for the push reusing
        them."""
        if not self.objects.exists(layer_key(digest)):
            return False
        self.objects.touch(layer_key(digest))
        for pack in sorted({loc.pack for loc in self.table(
                digest, register=False).locs.values()}):
            self.objects.touch(pack_key(pack))
        return True

    def push_layer(self, store: ChunkStore, digest: str, domain: TrustDomain,
                   manifest_ids: Sequence[ChunkId], data_ids: Iterable[ChunkId],
                   known: KnownLocations, *,
                   progress: Callable[[int], None] | None = None) -> LayerPush:
        """Make layer `digest` readable from the cluster: upload the stored
        records (no recompression) of its chunks (`manifest_ids`, the chunks
        of its serialized manifest, then `data_ids`) that `known` does not
        hold, then its location table. `known` (from `known_locations`) is
        updated with what was uploaded, so the next layer of the same push
        dedups against it. A chunk `store` does not hold must be in the
        cluster already (in `domain`); one held in another domain with the
        same BLAKE3 is shared, not uploaded again (the local store's rule).
        Call `reuse_layer` first: this uploads a table even if one is there."""
        report = LayerPush()
        ids = list(dict.fromkeys([*manifest_ids, *data_ids]))
        locs: dict[ChunkId, Loc] = {}
        missing = []
        local = [c for c, has in zip(ids, store.has_many(ids, domain), strict=True) if has]
        strong = dict(zip(local, store.strong_many(local, domain), strict=True))
        others: dict[bytes, list[Loc]] | None = None
        for cid in ids:
            loc = known.get((str(domain), bytes(cid)))
            if cid not in strong:
                # not stored here (a layer made of entries of layers the cluster
                # holds, e.g. a flattened snapshot chain): the cluster must have it
                if loc is None:
                    raise ChunkNotFound(cid, domain)
                strong[cid] = loc.strong
            if loc is not None and loc.strong != strong[cid]:
                # the cluster has another chunk under this id: never dedup on xxh3 alone
                raise ChunkCollision(cid, str(domain))
            if loc is None:
                # the local store's rule across domains: share another domain's
                # bytes only when their BLAKE3 digests match (identical content)
                if others is None:
                    others = defaultdict(list)
                    for (_, raw_id), other in known.items():
                        others[raw_id].append(other)
                loc = next((o for o in others.get(bytes(cid), ()) if o.strong == strong[cid]),
                           None)
                if loc is not None:
                    known[(str(domain), bytes(cid))] = loc
            if loc is not None:
                locs[cid] = loc
                report.chunks_deduped += 1
            else:
                missing.append(cid)
        for key, placed, nbytes in self._upload(store, missing, domain, strong):
            locs.update(placed)
            for cid, loc in placed.items():
                known[(str(domain), bytes(cid))] = loc
            report.packs += 1
            report.bytes_uploaded += nbytes
            report.chunks_uploaded += len(placed)
            if progress is not None:
                progress(nbytes)
            log.info("pushed pack %s (%d chunks)", key, len(placed))
        fresh = set(missing)
        for pack in sorted({loc.pack for cid, loc in locs.items() if cid not in fresh}):
            self.objects.touch(pack_key(pack))  # reused packs: a concurrent gc keeps them
        table = LocTable(domain, list(manifest_ids), locs)
        self.objects.put(layer_key(digest), table.encode())
        return report

    # -- garbage collection -----------------------------------------------------

    def collect(self, keep_layers: Collection[str], grace_seconds: float = 3600.0
                ) -> TableGcReport:
        """Delete the location tables of layers not in `keep_layers` and packs
        no kept table names; only objects older than the grace period, so a
        push in progress (packs, then tables; reused tables and packs touched
        first) is never collected under it. Packs are deleted whole: a pack
        some kept table still uses stays."""
        report = TableGcReport()
        keep_packs: set[str] = set()
        for key, age, _ in list(self.objects.list_ages("layers/")):
            digest = _digest_in(key, "layers/", ".loc")
            if digest in keep_layers or age < grace_seconds:
                try:
                    t = LocTable.decode(self.objects.get(key), key)
                except (ObjectNotFound, ChunkCorrupt):
                    continue
                keep_packs.update(loc.pack for loc in t.locs.values())
            else:
                self.objects.delete(key)
                report.tables += 1
        for key, age, size in list(self.objects.list_ages("packs/")):
            if key[len("packs/"):] in keep_packs or age < grace_seconds:
                continue
            self.objects.delete(key)
            report.packs += 1
            report.bytes_freed += size
        return report

    def _upload(self, store: ChunkStore, ids: list[ChunkId], domain: TrustDomain,
                strong: dict[ChunkId, bytes]) -> Iterator[tuple[str, dict[ChunkId, Loc], int]]:
        """Copy the stored records of `ids` (no recompression) into new packs
        of about PACK_TARGET bytes and upload each; yields (name, locations, size)."""
        parts: list[bytes] = [PACK_HEADER]
        size = len(PACK_HEADER)
        pending: dict[ChunkId, tuple[int, int, int, int]] = {}

        def flush() -> tuple[str, dict[ChunkId, Loc], int]:
            data = b"".join(parts)
            name = Digest.of(data).hex + ".pack"
            self.objects.put(pack_key(name), data)
            return name, {cid: Loc(name, off, s, n, c, strong[cid]) for cid, (off, s, n, c) in
                          pending.items()}, len(data)

        for batch_start in range(0, len(ids), 256):
            batch = ids[batch_start:batch_start + 256]
            for cid, (raw, stored, plain, codec) in zip(batch, store.raw_records(batch, domain),
                                                         strict=True):
                pending[cid] = (size, stored, plain, codec)
                parts.append(raw)
                size += len(raw)
                if size >= PACK_TARGET:
                    yield flush()
                    parts, size, pending = [PACK_HEADER], len(PACK_HEADER), {}
        if pending:
            yield flush()


def _digest_in(key: str, prefix: str, suffix: str) -> str | None:
    """The digest an object key `<prefix><digest key><suffix>` names, or None
    (a key this store did not write)."""
    if not (key.startswith(prefix) and key.endswith(suffix)):
        return None
    try:
        return Digest.from_key(key[len(prefix):len(key) - len(suffix)])
    except BadDigest:
        log.warning("cluster: object %s does not name a digest; ignored", key)
        return None
