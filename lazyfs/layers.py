"""The layers the daemon has loaded: catalog digest -> LayerTree (manifest
loaded once, however many requests ask at once) and LayerBlob (layout
computed once), and inode number -> layer.

Each layer takes the next free range of inode numbers when it loads: its
entries take base+1 .. base+n (base+n+1 and base+n+2 stay unused). Blob
files take theirs from a range of their own (BLOB_INODES, two per layer:
`.data`, `.map`) when first looked up, which may be before the layer loads
(BlobFile: an EROFS mount opening the blob needs only its size). Layers and
blob files stay loaded (inode numbers must stay stable while the kernel
caches them).

Owns no FUSE types: failures are the catalog's own errors, or
LayerLoadFailed for a load another request was doing; the FUSE adapter
(lazyfs/fs.py) turns them into errno values.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import trio

from composer.catalog import ImageCatalog

from .blob import BlobFile, LayerBlob
from .errors import LayerLoadFailed
from .trace import Tracer
from .tree import LayerTree

BLOB_INODES = 1 << 62  # blob files' inode numbers: two per layer from here


class Layers:
    def __init__(self, catalog: ImageCatalog, tracer: Tracer, first_base: int,
                 blob_size: Callable[[str], int | None] | None = None) -> None:
        self.catalog = catalog
        self.tracer = tracer
        # a layer's blob size without its manifest (its EROFS metadata image), or None
        self.blob_size = blob_size
        self.blob_files: dict[str, BlobFile] = {}
        self._blob_files_by_inode: dict[int, BlobFile] = {}
        self.trees: dict[int, LayerTree] = {}  # base -> tree
        self.by_digest: dict[str, LayerTree] = {}
        self.blobs: dict[str, LayerBlob] = {}  # digest -> blob, built on first use
        self._bases: list[int] = []  # sorted, for inode -> layer
        self._next_base = first_base
        self._loading: dict[str, trio.Event] = {}
        self._blob_loading: dict[str, trio.Event] = {}

    async def get(self, digest: str) -> LayerTree:
        """The tree of a layer, loading it on first use (once, however many ask)."""
        tree = self.by_digest.get(digest)
        if tree is not None:
            return tree
        ev = self._loading.get(digest)
        if ev is not None:
            await ev.wait()
            tree = self.by_digest.get(digest)
            if tree is None:
                raise LayerLoadFailed(f"layer {digest} failed to load")
            return tree
        ev = self._loading[digest] = trio.Event()
        try:
            manifest = await trio.to_thread.run_sync(self.catalog.load_layer, digest)
            tree = LayerTree.build(digest, manifest, self._next_base)
            # entries take base+1 .. base+n; base+n+1 is this layer's blob
            # file, base+n+2 (the next layer's base, never an entry) its
            # `.map` file (lazyfs/blob.py)
            self._next_base += len(tree.entries) + 2
            self.trees[tree.base] = tree
            self._bases.append(tree.base)  # increasing: bases only grow
            self.by_digest[digest] = tree
            self.tracer.layer_loaded(tree)
            return tree
        finally:
            del self._loading[digest]
            ev.set()

    async def find(self, digest: str) -> LayerTree | None:
        """The tree of a layer, or None when the catalog has no such layer."""
        tree = self.by_digest.get(digest)
        if tree is not None:
            return tree
        if not await trio.to_thread.run_sync(self.catalog.has_layer, digest):
            return None
        return await self.get(digest)

    async def exists(self, digest: str) -> bool:
        """Whether the catalog has the layer (without loading it)."""
        if digest in self.by_digest:
            return True
        return bool(await trio.to_thread.run_sync(self.catalog.has_layer, digest))

    async def digests(self) -> list[str]:
        """Every layer digest of the catalog (loaded or not)."""
        return await trio.to_thread.run_sync(self.catalog.list_layers)

    async def blob(self, digest: str) -> LayerBlob:
        """A layer's blob, its layout computed once (in a thread: a large
        layer takes a moment), however many ask."""
        blob = self.blobs.get(digest)
        if blob is not None:
            return blob
        tree = await self.get(digest)
        ev = self._blob_loading.get(digest)
        if ev is not None:
            await ev.wait()
            blob = self.blobs.get(digest)
            if blob is None:
                raise LayerLoadFailed(f"blob of layer {digest} failed to load")
            return blob
        ev = self._blob_loading[digest] = trio.Event()
        try:
            blob = await trio.to_thread.run_sync(LayerBlob.build, tree)
            self.blobs[digest] = blob
            return blob
        finally:
            del self._blob_loading[digest]
            ev.set()

    async def blob_file(self, digest: str) -> BlobFile:
        """A layer's blob file (inode numbers, size), from its metadata
        image's size when it names one (the layer itself loads later, on
        the first read), else from the loaded layer."""
        known = self.blob_files.get(digest)
        if known is not None:
            return known
        size = None
        if self.blob_size is not None:
            size = await trio.to_thread.run_sync(self.blob_size, digest)
        if size is None:
            size = (await self.blob(digest)).size
        known = self.blob_files.get(digest)  # another lookup got here meanwhile
        if known is not None:
            return known
        f = self.blob_files[digest] = BlobFile(digest, BLOB_INODES + 2 * len(self.blob_files),
                                               size)
        self._blob_files_by_inode[f.inode] = self._blob_files_by_inode[f.map_inode] = f
        return f

    def blob_file_of(self, inode: int) -> BlobFile | None:
        """The blob file whose `.data` or `.map` inode this is, if any."""
        return self._blob_files_by_inode.get(inode) if inode >= BLOB_INODES else None

    def _nearest(self, inode: int) -> LayerTree | None:
        k = bisect.bisect_right(self._bases, inode - 1) - 1
        return self.trees.get(self._bases[k]) if k >= 0 else None

    def tree_of(self, inode: int) -> LayerTree | None:
        """The loaded layer one of whose entries is this inode, if any."""
        tree = self._nearest(inode)
        if tree is None or inode - tree.base > len(tree.entries):
            return None
        return tree


