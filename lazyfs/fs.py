"""The lazyfs FUSE filesystem (pyfuse3 on trio): every layer in the catalog
as a read-only tree under `layers/<digest>/`, data fetched on first read
through the node cache.

    /                      the node mount (e.g. /run/lazyfs/mnt)
    /layers/               one directory per layer digest in the catalog
    /layers/<digest>/...   the layer's tree, as overlayfs wants a lower
    /blobs/<digest>.data   the layer's data as one flat file: the data device
                           of its EROFS image (pmem/erofs.py, lazyfs/blob.py)

Layers are loaded on first lookup and stay loaded (inode numbers must stay
stable while the kernel caches them). Everything is immutable, so entries and
attributes are cached by the kernel for a long time and open files keep the
page cache (`keep_cache`); one page-cache copy serves every sandbox.

Reads run the chunk fetch in worker threads (the store and cache are
blocking), at most `fetch_threads` at once, each bounded by `fetch_timeout`
(then EIO). A read that continues the previous read of the same open file
starts a background fetch of the next `readahead_chunks` chunks on a smaller
pool, so prefetch never takes the threads foreground reads need.
"""

from __future__ import annotations

import bisect
import collections
import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from chunkstore import ChunkId, ChunkStoreError
from chunkstore.cache import NodeCache
from composer.catalog import ImageCatalog
from composer.errors import ComposerError
from composer.manifest import Kind

from .blob import LayerBlob, blob_name, digest_of
from .trace import Tracer
from .tree import LayerTree

log = logging.getLogger(__name__)

ROOT = pyfuse3.ROOT_INODE
LAYERS = ROOT + 1
BLOBS = ROOT + 2
FIRST_BASE = BLOBS  # the first layer's entries start at inode BLOBS + 1


@dataclass
class Options:
    fetch_threads: int = 8
    prefetch_threads: int = 2
    fetch_timeout: float = 30.0
    readahead_chunks: int = 2
    keep_cache: bool = True  # keep the page cache across opens (content is immutable)
    hot_bytes: int = 32 << 20  # recently read chunks kept in memory (a 256 KiB chunk
    # serves two 128 KiB FUSE reads; the second should not go to a thread)
    cache_timeout: float = 24 * 3600.0  # entry/attr timeouts (metadata is immutable)
    # blob files bypass the FUSE page cache: the kernel EROFS mount over a blob
    # caches file pages itself (one copy, not two), and FUSE readahead on the
    # blob would fetch the neighbouring files' chunks. Off for users that must
    # mmap a blob (FUSE refuses shared mmap of direct_io files).
    blob_direct_io: bool = True
    # chunks fetched ahead of a sequential reader of a blob: EROFS asks for
    # 128 KiB at a time, one request in flight, so the next chunks must be
    # in memory before it asks (0: off)
    blob_readahead_chunks: int = 8


@dataclass
class _Handle:
    tree: LayerTree
    index: int
    mount: str
    next_offset: int = -1
    prefetched_to: int = -1


@dataclass
class _BlobHandle:
    blob: LayerBlob
    mount: str
    # one open blob serves every reader of a shared EROFS mount: sequential
    # streams are told apart by where each one's next read starts
    streams: collections.OrderedDict[int, None] = field(
        default_factory=collections.OrderedDict)
    prefetched: dict[int, int] = field(default_factory=dict)  # entry -> last chunk queued


@dataclass
class _Dir:
    names: list[bytes] = field(default_factory=list)
    inodes: list[int] = field(default_factory=list)


class LazyFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, catalog: ImageCatalog, cache: NodeCache, tracer: Tracer,
                 options: Options | None = None,
                 attribute: Callable[[int], str] | None = None) -> None:
        super().__init__()
        self.catalog = catalog
        self.cache = cache
        self.tracer = tracer
        self.options = options or Options()
        self.attribute = attribute or (lambda pid: "")
        self.trees: dict[int, LayerTree] = {}  # base -> tree
        self._bases: list[int] = []  # sorted, for inode -> layer
        self.by_digest: dict[str, LayerTree] = {}
        self._next_base = FIRST_BASE
        self._loading: dict[str, trio.Event] = {}
        self._handles: dict[int, _Handle | _BlobHandle | _Dir] = {}
        self.blobs: dict[str, LayerBlob] = {}  # digest -> blob, built on first lookup
        self._blob_loading: dict[str, trio.Event] = {}
        self._dir_inodes: dict[int, int] = {}
        self._next_fh = 1
        self._hot: collections.OrderedDict[tuple[str, bytes], bytes] = collections.OrderedDict()
        self._hot_size = 0
        self._fetch_limit = trio.CapacityLimiter(self.options.fetch_threads)
        self._prefetch_limit = trio.CapacityLimiter(self.options.prefetch_threads)
        self.nursery: trio.Nursery | None = None
        self.started = time.time()
        self.source = ""  # what it serves from (local store path or cluster URL)

    # -- layers ---------------------------------------------------------------

    async def layer(self, digest: str) -> LayerTree:
        """The tree of a layer, loading it on first use (once, however many ask)."""
        tree = self.by_digest.get(digest)
        if tree is not None:
            return tree
        ev = self._loading.get(digest)
        if ev is not None:
            await ev.wait()
            tree = self.by_digest.get(digest)
            if tree is None:
                raise pyfuse3.FUSEError(errno.EIO)
            return tree
        ev = self._loading[digest] = trio.Event()
        try:
            manifest = await trio.to_thread.run_sync(self.catalog.load_layer, digest)
            tree = LayerTree.build(digest, manifest, self._next_base)
            # entries take base+1 .. base+n; base+n+1 (the next layer's base,
            # never an entry) is this layer's blob file
            self._next_base += len(tree.entries) + 1
            self.trees[tree.base] = tree
            self._bases.append(tree.base)  # increasing: bases only grow
            self.by_digest[digest] = tree
            self.tracer.layer_loaded(tree)
            return tree
        finally:
            del self._loading[digest]
            ev.set()

    def _tree_of(self, inode: int) -> LayerTree:
        k = bisect.bisect_right(self._bases, inode - 1) - 1
        tree = self.trees.get(self._bases[k]) if k >= 0 else None
        if tree is None or inode - tree.base > len(tree.entries):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return tree

    async def blob(self, digest: str) -> LayerBlob:
        """A layer's blob, its layout computed once (in a thread: a large
        layer takes a moment), however many ask."""
        blob = self.blobs.get(digest)
        if blob is not None:
            return blob
        tree = await self.layer(digest)
        ev = self._blob_loading.get(digest)
        if ev is not None:
            await ev.wait()
            blob = self.blobs.get(digest)
            if blob is None:
                raise pyfuse3.FUSEError(errno.EIO)
            return blob
        ev = self._blob_loading[digest] = trio.Event()
        try:
            blob = await trio.to_thread.run_sync(LayerBlob.build, tree)
            self.blobs[digest] = blob
            return blob
        finally:
            del self._blob_loading[digest]
            ev.set()

    def _blob_of(self, inode: int) -> LayerBlob | None:
        """The blob whose file is this inode, if it is one."""
        k = bisect.bisect_right(self._bases, inode - 1) - 1
        tree = self.trees.get(self._bases[k]) if k >= 0 else None
        if tree is None or inode != tree.base + len(tree.entries) + 1:
            return None
        return self.blobs.get(tree.digest)

    # -- attributes -----------------------------------------------------------

    def _dir_attr(self, inode: int, nlink: int = 2) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.st_mode = stat.S_IFDIR | 0o755
        a.st_nlink = nlink
        a.st_blksize = 4096
        t = int(self.started * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        a.entry_timeout = a.attr_timeout = 1.0  # `layers/` grows as images arrive
        return a

    def _blob_attr(self, blob: LayerBlob) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = blob.inode
        a.st_mode = stat.S_IFREG | 0o444
        a.st_nlink = 1
        a.st_size = blob.size
        a.st_blksize = 128 << 10
        a.st_blocks = blob.size // 512
        t = int(self.started * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        a.entry_timeout = a.attr_timeout = self.options.cache_timeout
        return a

    def _attr(self, tree: LayerTree, i: int) -> pyfuse3.EntryAttributes:
        i = tree.target[i]
        e = tree.entries[i]
        a = pyfuse3.EntryAttributes()
        a.st_ino = tree.base + i + 1
        a.st_mode = tree.mode(i)
        a.st_nlink = tree.nlink[i]
        a.st_uid = e.uid
        a.st_gid = e.gid
        a.st_rdev = os.makedev(*tree.rdev(i))
        a.st_size = tree.size(i)
        a.st_blksize = 128 << 10
        a.st_blocks = tree.blocks[i]
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = e.mtime_ns
        a.entry_timeout = a.attr_timeout = self.options.cache_timeout
        return a

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        if inode == ROOT:
            return self._dir_attr(ROOT, 4)
        if inode in (LAYERS, BLOBS):
            return self._dir_attr(inode)
        blob = self._blob_of(inode)
        if blob is not None:
            return self._blob_attr(blob)
        tree = self._tree_of(inode)
        return self._attr(tree, tree.index(inode))

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if parent_inode == ROOT:
            if name == b"layers":
                return self._dir_attr(LAYERS)
            if name == b"blobs":
                return self._dir_attr(BLOBS)
            raise pyfuse3.FUSEError(errno.ENOENT)
        if parent_inode == LAYERS:
            tree = await self._lookup_layer(name.decode("utf-8", "replace"))
            return self._attr(tree, tree.root_index)
        if parent_inode == BLOBS:
            digest = digest_of(name)
            if digest is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            await self._lookup_layer(digest)
            try:
                blob = await self.blob(digest)
            except pyfuse3.FUSEError:
                raise
            except Exception as e:  # noqa: BLE001 - a bad manifest must not end the session
                log.error("blob of layer %s cannot be laid out: %s", digest, e)
                raise pyfuse3.FUSEError(errno.EIO) from None
            return self._blob_attr(blob)
        tree = self._tree_of(parent_inode)
        kids = tree.children.get(tree.index(parent_inode))
        if kids is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        j = kids.get(name)
        if j is None:
            return self._negative()
        return self._attr(tree, j)

    async def _lookup_layer(self, digest: str) -> LayerTree:
        tree = self.by_digest.get(digest)
        if tree is not None:
            return tree
        try:
            if not await trio.to_thread.run_sync(self.catalog.has_layer, digest):
                raise pyfuse3.FUSEError(errno.ENOENT)
            return await self.layer(digest)
        except pyfuse3.FUSEError:
            raise
        except Exception as e:  # noqa: BLE001 - a failing store must not end the session
            log.error("layer %s cannot be loaded: %s", digest, e)
            raise pyfuse3.FUSEError(errno.EIO) from None

    def _negative(self) -> pyfuse3.EntryAttributes:
        """A cacheable "no such entry" (inode 0): the kernel keeps the negative
        dentry for the entry timeout instead of asking again (the tree is
        immutable; Python's import system probes many missing paths)."""
        a = pyfuse3.EntryAttributes()
        a.st_ino = 0
        a.entry_timeout = self.options.cache_timeout
        return a

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        tree = self._tree_of(inode)
        e = tree.entries[tree.index(inode)]
        if e.kind != Kind.SYMLINK:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return e.target.encode("utf-8", "surrogateescape")

    # -- directories ----------------------------------------------------------

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        d = _Dir()
        if inode == ROOT:
            d.names, d.inodes = [b"blobs", b"layers"], [BLOBS, LAYERS]
        elif inode in (LAYERS, BLOBS):
            try:
                digests = await trio.to_thread.run_sync(self.catalog.list_layers)
            except Exception as e:  # noqa: BLE001 - a failing store must not end the session
                log.error("cannot list layers: %s", e)
                raise pyfuse3.FUSEError(errno.EIO) from None
            d.names = [(x if inode == LAYERS else blob_name(x)).encode() for x in digests]
        else:
            tree = self._tree_of(inode)
            i = tree.index(inode)
            if i not in tree.children:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            d.names = tree.child_order[i]
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = d
        self._dir_inodes[fh] = inode
        return fh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        d = self._handles[fh]
        assert isinstance(d, _Dir)
        parent = self._dir_inode(fh)
        for k in range(start_id, len(d.names)):
            name = d.names[k]
            try:
                attr = await self.lookup(parent, name)
            except pyfuse3.FUSEError:
                if parent in (LAYERS, BLOBS):
                    continue  # a layer that cannot load must not hide the others
                raise
            if not pyfuse3.readdir_reply(token, name, attr, k + 1):
                break

    def _dir_inode(self, fh: int) -> int:
        return self._dir_inodes[fh]

    async def releasedir(self, fh: int) -> None:
        self._handles.pop(fh, None)
        self._dir_inodes.pop(fh, None)

    # -- files ----------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        blob = self._blob_of(inode)
        if blob is not None:
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = _BlobHandle(blob, self.attribute(ctx.pid))
            if self.options.blob_direct_io:
                return pyfuse3.FileInfo(fh=fh, direct_io=True)
            return pyfuse3.FileInfo(fh=fh, keep_cache=self.options.keep_cache)
        tree = self._tree_of(inode)
        i = tree.target[tree.index(inode)]
        if tree.entries[i].kind != Kind.FILE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        fh = self._next_fh
        self._next_fh += 1
        handle = self._handles[fh] = _Handle(tree, i, self.attribute(ctx.pid))
        self.tracer.opened(tree, i, handle.mount)
        return pyfuse3.FileInfo(fh=fh, keep_cache=self.options.keep_cache)

    async def release(self, fh: int) -> None:
        self._handles.pop(fh, None)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handles.get(fh)
        if isinstance(h, _BlobHandle):
            if self.options.blob_readahead_chunks and self.nursery is not None:
                self._blob_readahead(h, off, min(size, h.blob.size - off))
            return await self._read_blob(h, off, size)
        if not isinstance(h, _Handle):
            raise pyfuse3.FUSEError(errno.EBADF)
        data = h.tree.file_data(h.index)
        span = data.span(off, size)
        if not span:
            return b""
        [out] = await self._read_ranges(h.tree, [(h.index, off, size)], h.mount,
                                        h.tree.entries[h.index].path)
        # sequential reading: fetch what comes next in the background
        if self.options.readahead_chunks and self.nursery is not None:
            if off == h.next_offset and span[-1] + 1 < len(data.ids):
                first = max(span[-1] + 1, h.prefetched_to + 1)
                last = min(span[-1] + self.options.readahead_chunks, len(data.ids) - 1)
                ahead = [c for c in data.ids[first:last + 1] if c is not None]
                if ahead:
                    h.prefetched_to = last
                    self.nursery.start_soon(self._prefetch, h.tree, h.index, ahead)
            h.next_offset = off + len(out)
        return out  # type: ignore[return-value]  # pyfuse3 takes any contiguous buffer

    async def _read_blob(self, h: _BlobHandle, off: int, size: int) -> bytes:
        """Blob bytes: the files behind the range (fetched together, traced
        as reads of those files) and zeros for padding and holes."""
        tree = h.blob.tree
        pieces = h.blob.pieces(off, size)
        ranges = [(p.entry, p.file_offset, p.length) for p in pieces if p.entry >= 0]
        for i, _, _ in ranges:
            self.tracer.opened(tree, i, h.mount)
        paths = [tree.entries[i].path for i, _, _ in ranges[:3]] + ["..."] * (len(ranges) > 3)
        what = f"blob bytes {off}+{size} ({', '.join(paths)})"
        views = iter(await self._read_ranges(tree, ranges, h.mount, what) if ranges else [])
        if len(pieces) == 1 and ranges:
            return next(views)  # type: ignore[return-value]  # any contiguous buffer will do
        return b"".join(next(views) if p.entry >= 0 else bytes(p.length) for p in pieces)

    def _blob_readahead(self, h: _BlobHandle, off: int, size: int) -> None:
        """A blob read that continues an earlier one (EROFS reads a file's
        blocks in order, 128 KiB at a time) starts a background fetch of the
        next chunks of the same file, never of its neighbours in the blob
        (they were not asked for). Called before the read is served: the
        kernel has several reads of a stream in flight at once."""
        sequential = off in h.streams
        h.streams.pop(off, None)
        h.streams[off + size] = None
        while len(h.streams) > 64:
            h.streams.popitem(last=False)
        if not sequential or size <= 0:
            return
        last = h.blob.pieces(off + size - 1, 1)
        if not last or last[0].entry < 0:
            return
        i, tree = last[0].entry, h.blob.tree
        data = tree.file_data(i)
        span = data.span(last[0].file_offset, 1)
        if not span:
            return
        first = max(span[-1] + 1, h.prefetched.get(i, -1) + 1)
        stop = min(span[-1] + self.options.blob_readahead_chunks, len(data.ids) - 1)
        ahead = [c for c in data.ids[first:stop + 1] if c is not None]
        if not ahead:
            return
        if len(h.prefetched) > 1024:
            h.prefetched.clear()
        h.prefetched[i] = stop
        assert self.nursery is not None
        self.nursery.start_soon(self._prefetch, tree, i, ahead)

    async def _read_ranges(self, tree: LayerTree, ranges: list[tuple[int, int, int]], mount: str,
                           what: str) -> list[memoryview]:
        """The bytes of (entry index, offset, size) file ranges of one layer,
        each chunk fetched once (hot set, node cache, then the store); every
        range is traced as a read of its file."""
        dom = str(tree.domain)
        spans: list[range] = []
        wanted: dict[ChunkId, None] = {}  # ordered, each chunk once
        for i, off, size in ranges:
            data = tree.file_data(i)
            span = data.span(off, size)
            spans.append(span)
            for k in span:
                cid = data.ids[k]
                if cid is not None:
                    wanted[cid] = None
        hot = {c: d for c in wanted if (d := self._hot_get(dom, c)) is not None}
        cold = [c for c in wanted if c not in hot]
        hits = len(hot) + sum(1 for c in cold if self.cache.contains(c, tree.domain))
        t0 = time.perf_counter()
        got = await self._fetch(tree, what, cold, foreground=True)
        for c, d in zip(cold, got, strict=True):
            hot[c] = d
            self._hot_put(dom, c, d)
        latency = time.perf_counter() - t0
        out: list[memoryview] = []
        for n, ((i, off, size), span) in enumerate(zip(ranges, spans, strict=True)):
            data = tree.file_data(i)
            self.tracer.read(tree, i, span, mount, latency, hits=hits if n == 0 else 0,
                             misses=len(wanted) - hits if n == 0 else 0)
            if not span:
                out.append(memoryview(b""))
                continue
            parts = []
            for k in span:
                cid = data.ids[k]
                parts.append(hot[cid] if cid is not None else bytes(data.lengths[k]))
            start = off - data.starts[span[0]]
            length = min(size, data.size - off)
            # one chunk (the common case): a view, no copy; pyfuse3 takes any buffer
            buf = memoryview(parts[0]) if len(parts) == 1 else memoryview(b"".join(parts))
            out.append(buf[start:start + length])
        return out

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
            _, old = self._hot.popitem(last=False)
            self._hot_size -= len(old)

    def drop_hot(self) -> None:
        self._hot.clear()
        self._hot_size = 0

    async def _fetch(self, tree: LayerTree, what: str, ids: list[ChunkId], *,
                     foreground: bool) -> list[bytes]:
        if not ids:
            return []
        limit = self._fetch_limit if foreground else self._prefetch_limit
        try:
            with trio.fail_after(self.options.fetch_timeout):
                return await trio.to_thread.run_sync(
                    functools.partial(self.cache.get_many, ids, tree.domain,
                                      wait_timeout=self.options.fetch_timeout),
                    limiter=limit, abandon_on_cancel=True)
        except (trio.TooSlowError, TimeoutError):
            log.error("read of %s in layer %s: fetch timed out after %gs", what,
                      tree.digest, self.options.fetch_timeout)
            self.tracer.error()
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception as e:  # noqa: BLE001 - whatever the store raised: EIO
            log.error("read of %s in layer %s failed: %s", what, tree.digest, e)
            self.tracer.error()
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def _prefetch(self, tree: LayerTree, i: int, ids: list[ChunkId]) -> None:
        missing = [c for c in ids if not self.cache.contains(c, tree.domain)]
        if not missing:
            return
        try:
            got = await self._fetch(tree, tree.entries[i].path, missing, foreground=False)
            self.tracer.prefetched(len(missing))
        except pyfuse3.FUSEError:
            return  # a foreground read will report it
        for c, d in zip(missing, got, strict=True):
            self._hot_put(str(tree.domain), c, d)

    async def prefetch_trace(self, events: list[dict[str, Any]]) -> int:
        """Fetch the chunks a recorded trace read, in its order, in the
        background pool. Events naming layers, paths or chunks this node does
        not have are skipped (a trace may come from another node or an older
        catalog). Returns how many chunks were fetched."""
        done = 0
        batch: list[ChunkId] = []
        tree: LayerTree | None = None
        bad_layers: set[str] = set()
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
                t = await self.layer(digest)
            except (ChunkStoreError, ComposerError, ValueError, pyfuse3.FUSEError) as e:
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
            if batch and tree is not None and (t.domain != tree.domain or len(batch) >= 8):
                await self._fetch_batch(tree, batch)
                done += len(batch)
                batch = []
            batch.append(cid)
            tree = t
        if batch and tree is not None:
            await self._fetch_batch(tree, batch)
            done += len(batch)
        self.tracer.prefetch_runs += 1
        return done

    async def _fetch_batch(self, tree: LayerTree, ids: list[ChunkId]) -> None:
        try:
            await self._fetch(tree, "a recorded trace", ids, foreground=False)
            self.tracer.prefetched(len(ids))
        except pyfuse3.FUSEError:
            pass

    # -- xattrs, statfs ---------------------------------------------------------

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode in (ROOT, LAYERS, BLOBS) or self._blob_of(inode) is not None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        tree = self._tree_of(inode)
        value = tree.xattrs(tree.target[tree.index(inode)]).get(
            name.decode("utf-8", "surrogateescape"))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if inode in (ROOT, LAYERS, BLOBS) or self._blob_of(inode) is not None:
            return []
        tree = self._tree_of(inode)
        names = tree.listed_xattrs(tree.target[tree.index(inode)])
        return [n.encode("utf-8", "surrogateescape") for n in names]

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        total = sum(t.data_size for t in self.trees.values())
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (total + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = sum(len(t.entries) for t in self.trees.values()) + 2
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return not mode & os.W_OK

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        return None
