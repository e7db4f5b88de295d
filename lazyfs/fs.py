"""The lazyfs FUSE filesystem (pyfuse3 on trio): every layer in the catalog
as a read-only tree under `layers/<digest>/`, data fetched on first read
through the node cache.

    /                      the node mount (e.g. /run/lazyfs/mnt)
    /layers/               one directory per layer digest in the catalog
    /layers/<digest>/...   the layer's tree, as overlayfs wants a lower
    /blobs/<digest>.data   the layer's data as one flat file: the data device
                           of its EROFS image (pmem/erofs.py, lazyfs/blob.py)
    /blobs/<digest>.map    the same bytes, page-cached and zero-padded to 2 MiB
                           units, to map shared (virtio-pmem backing of VMs)

This module is the thin pyfuse3.Operations adapter: it translates FUSE
requests into the layer table (lazyfs/layers.py: which layers are loaded,
inode -> layer), the fetch engine (lazyfs/fetch.py: the bytes behind reads,
hot set, pools, readahead, prefetch) and attributes, and raises only
pyfuse3.FUSEError (failures below become EIO, logged once where they
happen). The daemon (lazyfs/daemon.py) builds the three and wires them.

Everything is immutable, so entries and attributes are cached by the kernel
for a long time and open files keep the page cache (`keep_cache`); one
page-cache copy serves every sandbox.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyfuse3

from composer.manifest import Kind

from .blob import LayerBlob, blob_entry, blob_name, map_name
from .errors import FetchError, LayerLoadFailed
from .fetch import BlobReader, FetchEngine, FileReader
from .layers import Layers
from .options import Options
from .tree import LayerTree

if TYPE_CHECKING:
    from .autotrace import AutoTraces
    from .nativeblobs import BlobServer

log = logging.getLogger(__name__)

ROOT = pyfuse3.ROOT_INODE
LAYERS = ROOT + 1
BLOBS = ROOT + 2
FIRST_BASE = BLOBS  # the first layer's entries start at inode BLOBS + 1


@dataclass
class _Dir:
    names: list[bytes] = field(default_factory=list)
    inodes: list[int] = field(default_factory=list)


class LazyFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, layers: Layers, fetch: FetchEngine, options: Options | None = None,
                 attribute: Callable[[int], str] | None = None) -> None:
        super().__init__()
        self.layers = layers
        self.fetch = fetch
        self.options = options or Options()
        self.attribute = attribute or (lambda pid: "")  # reader pid -> its mount
        self._handles: dict[int, FileReader | BlobReader | _Dir] = {}
        self._dir_inodes: dict[int, int] = {}
        self._next_fh = 1
        self.started = time.time()
        self.source = ""  # what it serves from (local store path or cluster URL)
        self.traces: AutoTraces | None = None  # automatic traces (the daemon sets them)
        self.native: BlobServer | None = None  # the native blob server (the daemon's)

    # -- layers ---------------------------------------------------------------

    def _tree_of(self, inode: int) -> LayerTree:
        tree = self.layers.tree_of(inode)
        if tree is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return tree

    async def _lookup_layer(self, digest: str) -> LayerTree:
        try:
            tree = await self.layers.find(digest)
        except LayerLoadFailed:
            raise pyfuse3.FUSEError(errno.EIO) from None  # the loader logged why
        except Exception as e:  # noqa: BLE001 - a failing store must not end the session
            log.error("layer %s cannot be loaded: %s", digest, e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        if tree is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return tree

    async def _lookup_blob(self, digest: str) -> LayerBlob:
        await self._lookup_layer(digest)
        try:
            return await self.layers.blob(digest)
        except LayerLoadFailed:
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception as e:  # noqa: BLE001 - a bad manifest must not end the session
            log.error("blob of layer %s cannot be laid out: %s", digest, e)
            raise pyfuse3.FUSEError(errno.EIO) from None

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

    def _blob_attr(self, blob: LayerBlob, mapped: bool = False) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = blob.map_inode if mapped else blob.inode
        a.st_mode = stat.S_IFREG | 0o444
        a.st_nlink = 1
        a.st_size = blob.map_size if mapped else blob.size
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
        blob = self.layers.blob_of(inode)
        if blob is not None:
            return self._blob_attr(blob, inode == blob.map_inode)
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
            digest, mapped = blob_entry(name)
            if digest is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._blob_attr(await self._lookup_blob(digest), mapped)
        tree = self._tree_of(parent_inode)
        kids = tree.children.get(tree.index(parent_inode))
        if kids is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        j = kids.get(name)
        if j is None:
            return self._negative()
        return self._attr(tree, j)

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
                digests = await self.layers.digests()
            except Exception as e:  # noqa: BLE001 - a failing store must not end the session
                log.error("cannot list layers: %s", e)
                raise pyfuse3.FUSEError(errno.EIO) from None
            d.names = [x.encode() for x in digests] if inode == LAYERS else \
                [n(x).encode() for x in digests for n in (blob_name, map_name)]
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
        parent = self._dir_inodes[fh]
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

    async def releasedir(self, fh: int) -> None:
        self._handles.pop(fh, None)
        self._dir_inodes.pop(fh, None)

    # -- files ----------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        blob = self.layers.blob_of(inode)
        if blob is not None:
            fh = self._next_fh
            self._next_fh += 1
            mapped = inode == blob.map_inode
            self._handles[fh] = self.fetch.open_blob(blob, self.attribute(ctx.pid), mapped)
            if self.options.blob_direct_io and not mapped:
                return pyfuse3.FileInfo(fh=fh, direct_io=True)
            return pyfuse3.FileInfo(fh=fh, keep_cache=self.options.keep_cache)
        tree = self._tree_of(inode)
        i = tree.target[tree.index(inode)]
        if tree.entries[i].kind != Kind.FILE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = self.fetch.open_file(tree, i, self.attribute(ctx.pid))
        return pyfuse3.FileInfo(fh=fh, keep_cache=self.options.keep_cache)

    async def release(self, fh: int) -> None:
        self._handles.pop(fh, None)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handles.get(fh)
        try:
            if isinstance(h, BlobReader):
                return await self.fetch.read_blob(h, off, size)
            if isinstance(h, FileReader):
                return await self.fetch.read(h, off, size)
        except FetchError:
            raise pyfuse3.FUSEError(errno.EIO) from None  # logged by the engine
        raise pyfuse3.FUSEError(errno.EBADF)

    # -- xattrs, statfs ---------------------------------------------------------

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode in (ROOT, LAYERS, BLOBS) or self.layers.blob_of(inode) is not None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        tree = self._tree_of(inode)
        value = tree.xattrs(tree.target[tree.index(inode)]).get(
            name.decode("utf-8", "surrogateescape"))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if inode in (ROOT, LAYERS, BLOBS) or self.layers.blob_of(inode) is not None:
            return []
        tree = self._tree_of(inode)
        names = tree.listed_xattrs(tree.target[tree.index(inode)])
        return [n.encode("utf-8", "surrogateescape") for n in names]

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        trees = self.layers.trees.values()
        total = sum(t.data_size for t in trees)
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (total + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = sum(len(t.entries) for t in trees) + 2
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return not mode & os.W_OK

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        return None
