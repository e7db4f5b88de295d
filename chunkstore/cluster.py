"""The cluster chunk store: packs and per-layer location tables in a shared
object store (SeaweedFS/S3, or a POSIX mount every node sees).

Layout under the store's root (bucket/prefix or directory):

    packs/<blake3>.pack        pack objects (the chunk store's pack format:
                               header + self-describing records), named by
                               the BLAKE3 of their bytes, so packs from any
                               number of converters never collide
    layers/<digest>.loc        a layer's location table: for every chunk the
                               layer needs (its manifest's chunks and its file
                               data), the pack and byte range holding it
    images/<digest>.json       image records (layers + OCI config)
    tags/<quoted name>         name:tag -> image digest

Writers (`push`) upload packs first, then location tables, then image
records, then tags, each as one atomic object put: a reader never sees a
table pointing at bytes that are not there, nor a tag naming a partial image.

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
"""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack
import zstandard

from .codec import ChunkCodec, CodecError
from .errors import ChunkCollision, ChunkCorrupt, ChunkNotFound
from .ids import TRUSTED, ChunkId, TrustDomain, id_digest
from .objects import ObjectNotFound, ObjectStore
from .pack import MAX_CHUNK_SIZE, PACK_HEADER, RECORD_HEADER_SIZE, decode_record_header

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
    return f"layers/{digest.replace(':', '-')}.loc"


def image_key(digest: str) -> str:
    return f"images/{digest.replace(':', '-')}.json"


def tag_key(name: str) -> str:
    return "tags/" + urllib.parse.quote(name, safe="")


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
        results: dict[ChunkId, bytes] = {}
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
        buf = memoryview(self.objects.get_range(f"packs/{pack}", start, end - start))
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
class GcReport:
    images: int = 0
    tables: int = 0
    packs: int = 0
    bytes_freed: int = 0


@dataclass
class PushReport:
    image: str
    layers_pushed: int = 0
    layers_skipped: int = 0
    chunks_uploaded: int = 0
    chunks_deduped: int = 0
    bytes_uploaded: int = 0
    packs: int = 0
    seconds: float = 0.0


class Cluster:
    """An image catalog and chunk data in an object store."""

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
            name = key[len("layers/"):]
            if name.endswith(".loc"):
                out.append(name[:-4].replace("-", ":", 1))
        return out

    def load_manifest_bytes(self, digest: str) -> tuple[bytes, TrustDomain]:
        t = self.table(digest)
        raw = b"".join(self.reader.get_many(t.manifest, t.domain))
        if "blake3:" + blake3.blake3(raw).hexdigest() != digest:
            raise ChunkCorrupt("-", layer_key(digest), "manifest does not match its digest")
        return raw, t.domain

    def resolve(self, name: str) -> tuple[str, dict[str, Any]]:
        """(image digest, image record) for a tag or an image digest."""
        if name.startswith("blake3:"):
            digest = name
        else:
            tag = name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"
            try:
                digest = self.objects.get(tag_key(tag)).decode().strip()
            except ObjectNotFound:
                raise ChunkNotFound(name, "cluster catalog") from None
        raw = self.objects.get(image_key(digest))
        if "blake3:" + blake3.blake3(raw).hexdigest() != digest:
            raise ChunkCorrupt("-", image_key(digest), "image record does not match its digest")
        doc: dict[str, Any] = json.loads(raw)
        return digest, doc

    def list_tags(self) -> list[tuple[str, str]]:
        out = []
        for key in self.objects.list("tags/"):
            out.append((urllib.parse.unquote(key[len("tags/"):]),
                        self.objects.get(key).decode().strip()))
        return out

    # -- writing (what a converter does after a local conversion) --------------

    def known_locations(self) -> dict[tuple[str, bytes], Loc]:
        """Every chunk location the cluster's layers name (for dedup on push)."""
        out: dict[tuple[str, bytes], Loc] = {}
        for digest in self.list_layers():
            try:
                t = self.table(digest, register=False)  # push does not read through them
            except (ObjectNotFound, ChunkCorrupt) as e:
                log.warning("push: location table of %s skipped: %s", digest, e)
                continue
            for cid, loc in t.locs.items():
                out[(str(t.domain), bytes(cid))] = loc
        return out

    def push(self, store: Any, catalog: Any, name: str, *,
             progress: Callable[[int], None] | None = None) -> PushReport:
        """Upload image `name` from a local store + catalog. Idempotent: layers
        already in the cluster are skipped, chunks it already has are not
        uploaded again."""
        t0 = time.perf_counter()
        digest, image = catalog.resolve(name)
        report = PushReport(digest)
        known = self.known_locations()
        for layer in image.layers:
            if self.objects.exists(layer_key(layer)):
                # reused: its age restarts, so a concurrent gc keeps it (and its packs)
                self.objects.touch(layer_key(layer))
                for pack in sorted({loc.pack for loc in self.table(
                        layer, register=False).locs.values()}):
                    self.objects.touch(f"packs/{pack}")
                report.layers_skipped += 1
                continue
            rec = catalog.layer_info(layer)
            domain = TrustDomain(rec["domain"])
            manifest_ids = [ChunkId.from_hex(h) for h in rec["chunks"]]
            manifest = catalog.load_layer(layer)
            ids = list(dict.fromkeys([*manifest_ids, *sorted(manifest.chunk_ids())]))
            locs: dict[ChunkId, Loc] = {}
            missing = []
            strong = dict(zip(ids, store.strong_many(ids, domain), strict=True))
            for cid in ids:
                loc = known.get((str(domain), bytes(cid)))
                if loc is not None and loc.strong != strong[cid]:
                    # the cluster has another chunk under this id: never dedup on xxh3 alone
                    raise ChunkCollision(cid, str(domain))
                if loc is not None:
                    locs[cid] = loc
                    report.chunks_deduped += 1
                else:
                    missing.append(cid)
            for pack_key, placed, nbytes in self._upload(store, missing, domain, strong):
                locs.update(placed)
                for cid, loc in placed.items():
                    known[(str(domain), bytes(cid))] = loc
                report.packs += 1
                report.bytes_uploaded += nbytes
                report.chunks_uploaded += len(placed)
                if progress is not None:
                    progress(nbytes)
                log.info("pushed pack %s (%d chunks)", pack_key, len(placed))
            fresh = set(missing)
            for pack in sorted({loc.pack for cid, loc in locs.items() if cid not in fresh}):
                self.objects.touch(f"packs/{pack}")  # reused packs: a concurrent gc keeps them
            table = LocTable(domain, manifest_ids, locs)
            self.objects.put(layer_key(layer), table.encode())
            report.layers_pushed += 1
        self.objects.put(image_key(digest), image.to_json())
        if not name.startswith("blake3:"):
            tag = name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"
            self.objects.put(tag_key(tag), digest.encode())
        report.seconds = time.perf_counter() - t0
        return report

    # -- tags and garbage collection ------------------------------------------

    def remove_tag(self, name: str) -> None:
        tag = name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"
        if not self.objects.exists(tag_key(tag)):
            raise ChunkNotFound(name, "cluster catalog")
        self.objects.delete(tag_key(tag))

    def gc(self, grace_seconds: float = 3600.0) -> GcReport:
        """Delete what no tag reaches: untagged image records, location tables
        no image names, packs no table names; only objects older than the grace
        period, so a push in progress (packs, then tables, then image, then tag;
        reused tables and packs touched first) is never collected under it.
        Packs are deleted whole: a pack some kept table still uses stays."""
        report = GcReport()
        tagged = {self.objects.get(k).decode().strip() for k in self.objects.list("tags/")}
        keep_layers: set[str] = set()
        for key, age, _ in list(self.objects.list_ages("images/")):
            digest = key[len("images/"):-len(".json")].replace("-", ":", 1)
            if digest in tagged or age < grace_seconds:
                try:
                    keep_layers.update(json.loads(self.objects.get(key))["layers"])
                except (ObjectNotFound, ValueError, KeyError, TypeError):
                    continue
            else:
                self.objects.delete(key)
                report.images += 1
        keep_packs: set[str] = set()
        for key, age, _ in list(self.objects.list_ages("layers/")):
            digest = key[len("layers/"):-len(".loc")].replace("-", ":", 1)
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

    def _upload(self, store: Any, ids: list[ChunkId], domain: TrustDomain,
                strong: dict[ChunkId, bytes]) -> Iterator[tuple[str, dict[ChunkId, Loc], int]]:
        """Copy the stored records of `ids` (no recompression) into new packs
        of about PACK_TARGET bytes and upload each; yields (key, locations, size)."""
        parts: list[bytes] = [PACK_HEADER]
        size = len(PACK_HEADER)
        pending: dict[ChunkId, tuple[int, int, int, int]] = {}

        def flush() -> tuple[str, dict[ChunkId, Loc], int]:
            data = b"".join(parts)
            key = blake3.blake3(data).hexdigest() + ".pack"
            self.objects.put(f"packs/{key}", data)
            return key, {cid: Loc(key, off, s, n, c, strong[cid]) for cid, (off, s, n, c) in
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
