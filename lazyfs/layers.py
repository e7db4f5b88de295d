"""The layers the daemon has loaded: catalog digest -> LayerTree (manifest
loaded once, however many requests ask at once) and LayerBlob (layout
computed once), and inode number -> layer.

Each layer takes the next free range of inode numbers when it loads: its
entries take base+1 .. base+n, base+n+1 is its blob file and base+n+2
(never an entry: the next layer's base) the blob's `.map` file. Layers stay loaded (inode numbers must stay
stable while the kernel caches them).

Owns no FUSE types: failures are the catalog's own errors, or
LayerLoadFailed for a load another request was doing; the FUSE adapter
(lazyfs/fs.py) turns them into errno values.
"""

from __future__ import annotations

import bisect

import trio

from composer.catalog import ImageCatalog

from .blob import LayerBlob
from .errors import LayerLoadFailed
from .trace import Tracer
from .tree import LayerTree


class Layers:
    def __init__(self, catalog: ImageCatalog, tracer: Tracer, first_base: int) -> None:
        self.catalog = catalog
        self.tracer = tracer
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

    def _nearest(self, inode: int) -> LayerTree | None:
        k = bisect.bisect_right(self._bases, inode - 1) - 1
        return self.trees.get(self._bases[k]) if k >= 0 else None

    def tree_of(self, inode: int) -> LayerTree | None:
        """The loaded layer one of whose entries is this inode, if any."""
        tree = self._nearest(inode)
        if tree is None or inode - tree.base > len(tree.entries):
            return None
        return tree

    def blob_of(self, inode: int) -> LayerBlob | None:
        """The blob whose file (`.data` or `.map`) is this inode, if it is one."""
        tree = self._nearest(inode)
        if tree is None or inode - tree.base - len(tree.entries) not in (1, 2):
            return None
        return self.blobs.get(tree.digest)
