"""The fetch engine of the lazyfs daemon: the bytes behind reads of layer
files and blobs, fetched through the node cache, and everything that makes
that fast: the hot set, the two thread pools, readahead and trace prefetch.

Interface (the FUSE adapter, lazyfs/fs.py, is its one user; the daemon
wires them and sets `nursery`):

    engine = FetchEngine(cache, tracer, layers, options)
    f = engine.open_file(tree, index, mount)  ->  FileReader (traced as opened)
    await engine.read(f, offset, size)        ->  the bytes (a buffer), + readahead
    b = engine.open_blob(blob, mount)         ->  BlobReader
    await engine.read_blob(b, offset, size)   ->  the bytes, + blob readahead
    await engine.prefetch_trace(events)       ->  chunks fetched (a recorded trace)
    engine.drop_hot()                         ->  forget the hot set

Reads raise FetchError (already logged and counted) when chunks cannot be
fetched; nothing here knows about FUSE.

How a read is served: each chunk once, from the hot set (recently read
chunks, in memory, `hot_bytes`), else the node cache (chunkstore/cache.py:
local files, single flight, filled from the store). Cache fetches run in
worker threads (the cache and store are blocking), at most `fetch_threads`
at once, each bounded by `fetch_timeout`, except small foreground fetches
from a local source (`inline_fetch_bytes`: the node's own store, or chunks
already in the node cache), which run on the event loop: there the thread
round trip costs several times the fetch. Chunks read from a local store
are not copied into the node cache (`keep_local_reads`) unless a trace
prefetch asked for them. Background fetches (readahead,
trace prefetch) run on a smaller pool of `prefetch_threads`, so they never
take the threads foreground reads need:

- a read of a file that continues its previous read fetches the next
  `readahead_chunks` chunks;
- a blob read that continues an earlier read of the same blob (EROFS reads
  a file's blocks in order) fetches the next `blob_readahead_chunks` chunks
  of the file behind it, never of its neighbours in the blob.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from chunkstore import ChunkId, ChunkStore, ChunkStoreError, TrustDomain
from chunkstore.cache import NodeCache
from composer.errors import ComposerError
from composer.manifest import Kind

from .blob import LayerBlob
from .errors import FetchError, ServeError
from .layers import Layers
from .opens import OpenWatches
from .options import Options
from .trace import Tracer
from .tree import LayerTree

log = logging.getLogger(__name__)

# chunks a trace replay fetches in one batch (one prefetch thread's serial
# fetch): neighbours in the trace are neighbours in the cluster's packs
# (composer.push packs a layer's chunks in file order), so a batch is a few
# ranged GETs however many chunks it holds
REPLAY_BATCH = 32


@dataclass
class FileReader:
    """One open file of a layer tree: where its previous read ended and how
    far readahead already went."""

    tree: LayerTree
    index: int
    mount: str
    next_offset: int = -1
    prefetched_to: int = -1


@dataclass
class BlobReader:
    """One open blob file."""

    blob: LayerBlob
    mount: str
    mapped: bool = False  # the `.map` file: zeros after the blob, up to blob.map_size
    # one open blob serves every reader of a shared EROFS mount: sequential
    # streams are told apart by where each one's next read starts
    streams: collections.OrderedDict[int, None] = field(
        default_factory=collections.OrderedDict)
    prefetched: dict[int, int] = field(default_factory=dict)  # entry -> last chunk queued


class FetchEngine:
    def __init__(self, cache: NodeCache, tracer: Tracer, layers: Layers,
                 options: Options, *, local_store: ChunkStore | None = None) -> None:
        self.cache = cache
        # where misses come from when it is a store on this node's disk
        # (None: a cluster store)
        self.local_store = local_store
        self.tracer = tracer
        self.layers = layers
        self.options = options
        self.nursery: trio.Nursery | None = None  # background fetches run here (None: none)
        self._hot: collections.OrderedDict[tuple[str, bytes], bytes] = collections.OrderedDict()
        self._hot_size = 0
        self._fetch_limit = trio.CapacityLimiter(options.fetch_threads)
        self._prefetch_limit = trio.CapacityLimiter(options.prefetch_threads)
        # bytes served of each hot chunk, while partly-read chunks leaving the
        # hot set are spilled into the node cache (a local store whose reads
        # are not kept: _spill_partial)
        self._served: dict[tuple[str, bytes], int] = {}
        self._spill = local_store is not None and not options.keep_local_reads
        # layers whose blob readahead is off for now: a trace replay reading
        # its chunks' pages in (lazyfs.autotrace) must not read past them
        self.quiet_layers: collections.Counter[str] = collections.Counter()
        # the kernel path's record of which composed mount opened which
        # layer file (the daemon sets it; None: blob reads are the opener's)
        self.opens: OpenWatches | None = None

    @property
    def prefetch_limit(self) -> trio.CapacityLimiter:
        """The background pool's threads (readahead, trace replay)."""
        return self._prefetch_limit

    # -- reads ------------------------------------------------------------------

    def open_file(self, tree: LayerTree, index: int, mount: str) -> FileReader:
        self.tracer.opened(tree, index, mount)
        return FileReader(tree, index, mount)

    def open_blob(self, blob: LayerBlob, mount: str, mapped: bool = False) -> BlobReader:
        return BlobReader(blob, mount, mapped)

    async def read(self, f: FileReader, off: int, size: int) -> bytes:
        """Bytes [off, off+size) of an open file (fewer at its end); a read
        continuing the previous one starts readahead."""
        data = f.tree.file_data(f.index)
        span = data.span(off, size)
        if not span:
            return b""
        [out] = await self._read_ranges(f.tree, [(f.index, off, size)], f.mount,
                                        f.tree.entries[f.index].path)
        # sequential reading: fetch what comes next in the background
        if self.options.readahead_chunks and self.nursery is not None:
            if off == f.next_offset and span[-1] + 1 < len(data.ids):
                first = max(span[-1] + 1, f.prefetched_to + 1)
                last = min(span[-1] + self.options.readahead_chunks, len(data.ids) - 1)
                ahead = [c for c in data.ids[first:last + 1] if c is not None]
                if ahead:
                    f.prefetched_to = last
                    self.nursery.start_soon(self._prefetch, f.tree, f.index, ahead)
            f.next_offset = off + len(out)
        return out  # type: ignore[return-value]  # pyfuse3 takes any contiguous buffer

    async def read_blob(self, b: BlobReader, off: int, size: int) -> bytes:
        """Blob bytes: the files behind the range (fetched together, traced
        as reads of those files) and zeros for padding and holes. A read
        continuing an earlier one starts readahead first (the kernel has
        several reads of a stream in flight at once). Reads of a `.map`
        file past the blob are zeros up to its padded size, always whole: a
        short read of a page-cached FUSE file would shrink it to the blob's
        size and a mapping of the padding would then fault."""
        if b.mapped and off + size > b.blob.size:
            end = min(off + size, b.blob.map_size)
            head = await self.read_blob(BlobReader(b.blob, b.mount), off,
                                        max(0, b.blob.size - off)) if off < b.blob.size else b""
            return bytes(head) + bytes(max(0, end - max(off, b.blob.size)))
        # (not for `.map`: the kernel reads around each page fault of a mapping itself)
        if self.options.blob_readahead_chunks and self.nursery is not None and not b.mapped:
            self._blob_readahead(b, off, min(size, b.blob.size - off))
        tree = b.blob.tree
        pieces = b.blob.pieces(off, size)
        ranges = [(p.entry, p.file_offset, p.length) for p in pieces if p.entry >= 0]
        mounts = self._blob_readers(b, ranges)
        for (i, _, _), mount in zip(ranges, mounts, strict=True):
            self.tracer.opened(tree, i, mount)
        paths = [tree.entries[i].path for i, _, _ in ranges[:3]] + ["..."] * (len(ranges) > 3)
        what = f"blob bytes {off}+{size} ({', '.join(paths)})"
        views = iter(await self._read_ranges(tree, ranges, b.mount, what, mounts)
                     if ranges else [])
        if len(pieces) == 1 and ranges:
            return next(views)  # type: ignore[return-value]  # any contiguous buffer will do
        return b"".join(next(views) if p.entry >= 0 else bytes(p.length) for p in pieces)

    def _blob_readers(self, b: BlobReader, ranges: list[tuple[int, int, int]]) -> list[str]:
        """The composed mount each file range of a blob read is for: the
        one that last opened the file (lazyfs.opens, the kernel path's
        record of opens, drained first: an open is queued before the reads
        that follow it), else the blob's opener."""
        if self.opens is None or b.mapped:
            return [b.mount] * len(ranges)
        self.opens.drain()
        digest = b.blob.tree.digest
        return [self.opens.opener(digest, i) or b.mount for i, _, _ in ranges]

    def _blob_readahead(self, b: BlobReader, off: int, size: int) -> None:
        """A blob read that continues an earlier one (EROFS reads a file's
        blocks in order, 128 KiB at a time) starts a background fetch of the
        next chunks of the same file, never of its neighbours in the blob
        (they were not asked for)."""
        sequential = off in b.streams
        b.streams.pop(off, None)
        b.streams[off + size] = None
        while len(b.streams) > 64:
            b.streams.popitem(last=False)
        if not sequential or size <= 0 or self.quiet_layers[b.blob.tree.digest]:
            return
        last = b.blob.pieces(off + size - 1, 1)
        if not last or last[0].entry < 0:
            return
        i, tree = last[0].entry, b.blob.tree
        data = tree.file_data(i)
        span = data.span(last[0].file_offset, 1)
        if not span:
            return
        first = max(span[-1] + 1, b.prefetched.get(i, -1) + 1)
        stop = min(span[-1] + self.options.blob_readahead_chunks, len(data.ids) - 1)
        ahead = [c for c in data.ids[first:stop + 1] if c is not None]
        if not ahead:
            return
        if len(b.prefetched) > 1024:
            b.prefetched.clear()
        b.prefetched[i] = stop
        assert self.nursery is not None
        self.nursery.start_soon(self._prefetch, tree, i, ahead)

    async def _read_ranges(self, tree: LayerTree, ranges: list[tuple[int, int, int]], mount: str,
                           what: str, mounts: list[str] | None = None) -> list[memoryview]:
        """The bytes of (entry index, offset, size) file ranges of one layer,
        each chunk fetched once (hot set, node cache, then the store); every
        range is traced as a read of its file by `mount` (or by mounts[k],
        one per range)."""
        dom = str(tree.domain)
        spans: list[range] = []
        wanted: dict[ChunkId, int] = {}  # ordered, each chunk once: its length
        for i, off, size in ranges:
            data = tree.file_data(i)
            span = data.span(off, size)
            spans.append(span)
            for k in span:
                cid = data.ids[k]
                if cid is not None:
                    wanted[cid] = data.lengths[k]
        hot = {c: d for c in wanted if (d := self._hot_get(dom, c)) is not None}
        cold = [c for c in wanted if c not in hot]
        missing = [c for c in cold if not self.cache.contains(c, tree.domain)]
        hits = len(wanted) - len(missing)
        t0 = time.perf_counter()
        got = await self._fetch(tree, what, cold, foreground=True,
                                inline=self._inline(tree, cold, missing, wanted))
        for c, d in zip(cold, got, strict=True):
            hot[c] = d
            self._hot_put(dom, c, d)
        latency = time.perf_counter() - t0
        out: list[memoryview] = []
        for n, ((i, off, size), span) in enumerate(zip(ranges, spans, strict=True)):
            data = tree.file_data(i)
            self.tracer.read(tree, i, span, mount if mounts is None else mounts[n], latency,
                             hits=hits if n == 0 else 0,
                             misses=len(wanted) - hits if n == 0 else 0)
            if not span:
                out.append(memoryview(b""))
                continue
            parts = []
            end = off + size
            for k in span:
                cid = data.ids[k]
                parts.append(hot[cid] if cid is not None else bytes(data.lengths[k]))
                if cid is not None and self._spill:
                    c0 = data.starts[k]
                    key = (dom, bytes(cid))
                    self._served[key] = self._served.get(key, 0) + (
                        min(end, c0 + data.lengths[k]) - max(off, c0))
            start = off - data.starts[span[0]]
            length = min(size, data.size - off)
            # one chunk (the common case): a view, no copy; pyfuse3 takes any buffer
            buf = memoryview(parts[0]) if len(parts) == 1 else memoryview(b"".join(parts))
            out.append(buf[start:start + length])
        return out

    # -- the hot set ----------------------------------------------------------------

    def _hot_get(self, dom: str, cid: ChunkId) -> bytes | None:
        d = self._hot.get((dom, cid))
        if d is not None:
            self._hot.move_to_end((dom, cid))
        return d

    def _hot_put(self, dom: str, cid: ChunkId, data: bytes) -> None:
        key = (dom, bytes(cid))
        if key in self._hot:
            return
        self._hot[key] = data
        self._hot_size += len(data)
        while self._hot_size > self.options.hot_bytes and self._hot:
            old_key, old = self._hot.popitem(last=False)
            self._hot_size -= len(old)
            self._spill_partial(old_key, old)

    def _spill_partial(self, key: tuple[str, bytes], data: bytes) -> None:
        """A chunk leaving the hot set whose bytes were not all served yet
        (a file read in parts, e.g. a binary's pages faulted in over time)
        is kept in the node cache: its other parts are likely read later,
        and would otherwise come from the store a second time. Chunks read
        whole are not (their pages are in the page cache); with a remote
        source or keep_local_reads every chunk is kept anyway."""
        served = self._served.pop(key, 0)
        if self._spill and served < len(data):
            self.cache.keep(ChunkId(key[1]), TrustDomain(key[0]), data)

    def drop_hot(self) -> None:
        self._hot.clear()
        self._hot_size = 0
        self._served.clear()

    # -- fetching -------------------------------------------------------------------

    def _inline(self, tree: LayerTree, cold: list[ChunkId], missing: list[ChunkId],
                lengths: dict[ChunkId, int]) -> bool:
        """Whether a foreground fetch may run on the event loop: small, and
        nothing in it can block for long (chunks in the node cache, or in
        packs of the local store that are already open; a pack's first
        open goes to a thread, bounded by the fetch timeout)."""
        if not cold or sum(lengths[c] for c in cold) > self.options.inline_fetch_bytes:
            return False
        if not missing:
            return True
        return self.local_store is not None and self.local_store.packs_open(missing,
                                                                           tree.domain)

    async def _fetch(self, tree: LayerTree, what: str, ids: list[ChunkId], *,
                     foreground: bool, inline: bool = False, keep: bool = False
                     ) -> list[bytes]:
        """The chunks' bytes through the node cache, kept there when `keep`
        or the source is remote; `inline`: on the event loop (a small fetch
        from local disk), else in a worker thread of the pool."""
        if not ids:
            return []
        limit = self._fetch_limit if foreground else self._prefetch_limit
        get = functools.partial(self.cache.get_many, ids, tree.domain,
                                wait_timeout=self.options.fetch_timeout,
                                keep=keep or self.options.keep_local_reads
                                or self.local_store is None)
        try:
            if inline:
                return get()
            with trio.fail_after(self.options.fetch_timeout):
                return await trio.to_thread.run_sync(get, limiter=limit,
                                                     abandon_on_cancel=True)
        except (trio.TooSlowError, TimeoutError):
            log.error("read of %s in layer %s: fetch timed out after %gs", what,
                      tree.digest, self.options.fetch_timeout)
            self.tracer.error()
            raise FetchError(f"read of {what} in layer {tree.digest}: timed out") from None
        except Exception as e:  # noqa: BLE001 - whatever the store raised: a FetchError
            log.error("read of %s in layer %s failed: %s", what, tree.digest, e)
            self.tracer.error()
            raise FetchError(f"read of {what} in layer {tree.digest} failed: {e}") from None

    async def _prefetch(self, tree: LayerTree, i: int, ids: list[ChunkId]) -> None:
        dom = str(tree.domain)
        missing = [c for c in ids if (dom, bytes(c)) not in self._hot
                   and not self.cache.contains(c, tree.domain)]
        if not missing:
            return
        try:
            got = await self._fetch(tree, tree.entries[i].path, missing, foreground=False)
            self.tracer.prefetched(len(missing))
        except FetchError:
            return  # a foreground read will report it
        for c, d in zip(missing, got, strict=True):
            self._hot_put(str(tree.domain), c, d)

    async def prefetch_trace(self, events: list[dict[str, Any]]) -> int:
        """Fetch the chunks a recorded trace read, in its order, in the
        background pool. Events naming layers, paths or chunks this node does
        not have are skipped (a trace may come from another node or an older
        catalog). Returns how many chunks were fetched."""
        bad_layers: set[str] = set()
        # batches in flight together, one per prefetch thread (each batch is
        # one thread's serial fetch): in trace order, so the reader that
        # follows the trace finds its next chunks on their way
        slots = trio.Semaphore(self.options.prefetch_threads)

        async def one(t: LayerTree, ids: list[ChunkId]) -> None:
            try:
                await self._fetch_batch(t, ids)
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            done = await self._replay(events, nursery, slots, one, bad_layers)
        self.tracer.prefetch_runs += 1
        return done

    async def _replay(self, events: list[dict[str, Any]], nursery: trio.Nursery,
                      slots: trio.Semaphore,
                      one: Callable[[LayerTree, list[ChunkId]], Awaitable[None]],
                      bad_layers: set[str]) -> int:
        done = 0
        batch: list[ChunkId] = []
        tree: LayerTree | None = None
        for n, ev in enumerate(events):
            if n % 256 == 255:
                await trio.lowlevel.checkpoint()  # never hold the loop for long
            try:
                digest, path, k = str(ev["layer"]), str(ev["path"]), int(ev["chunk"])
            except (KeyError, TypeError, ValueError):
                continue
            if digest in bad_layers:
                continue
            try:
                t = await self.layers.get(digest)
            except (ChunkStoreError, ComposerError, ValueError, ServeError) as e:
                log.warning("prefetch: layer %s skipped: %s", digest, e)
                bad_layers.add(digest)
                continue
            idx = t.path_index(path)
            if idx is None or t.entries[idx].kind != Kind.FILE:
                continue
            ids = t.file_data(idx).ids
            cid = ids[k] if 0 <= k < len(ids) else None
            if cid is None or self.cache.contains(cid, t.domain):
                continue
            if batch and tree is not None and (t.domain != tree.domain or len(batch) >= REPLAY_BATCH):
                await slots.acquire()
                nursery.start_soon(one, tree, batch)
                done += len(batch)
                batch = []
            batch.append(cid)
            tree = t
        if batch and tree is not None:
            await slots.acquire()
            nursery.start_soon(one, tree, batch)
            done += len(batch)
        return done

    async def _fetch_batch(self, tree: LayerTree, ids: list[ChunkId]) -> None:
        try:
            await self._fetch(tree, "a recorded trace", ids, foreground=False, keep=True)
            self.tracer.prefetched(len(ids))
        except FetchError:
            pass
