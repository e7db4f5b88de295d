"""A layer's data as one flat, read-only file: the blob that the layer's
EROFS image (pmem/erofs.py) names as its data device, served by the daemon
as `blobs/<digest>.data`, and the same bytes as `blobs/<digest>.map` for
mapping (virtio-pmem: QEMU maps it shared into guests).

The two differ only in how the kernel caches them: `.data` is direct_io
(the host's EROFS mount caches file pages itself, and no FUSE readahead
pulls in neighbouring files' chunks); `.map` goes through the FUSE page
cache, which a shared mmap needs (FUSE refuses it on direct_io files), and
is padded with zeros to whole MAP_ALIGN units (virtio-pmem maps regions in
2 MiB units). A page of `.map` that a mapping touches is fetched then,
through the same engine: a guest's page fault on missing data fetches just
the chunks behind that page.

The blob holds no bytes of its own: composer.bloblayout.BlobLayout maps each
blob range back to (file, offset), and the daemon reads those through the same
fetch engine (lazyfs/fetch.py) as reads of the layer's tree, so a kernel
EROFS mount over this file fetches only the chunks behind what it reads and
counts toward the layer's touched figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer.bloblayout import BlobLayout, BlobPiece
from composer.manifest import LayerManifest

from .tree import LayerTree

SUFFIX = ".data"
MAP_SUFFIX = ".map"
MAP_ALIGN = 2 << 20  # a `.map` file's size is a multiple of this


def blob_name(digest: str) -> str:
    return digest + SUFFIX


def map_name(digest: str) -> str:
    """The `blobs/` entry of a layer's blob for mapping (padded, page-cached)."""
    return digest + MAP_SUFFIX


def map_size(size: int) -> int:
    """A blob of `size` bytes padded to whole MAP_ALIGN units (at least one)."""
    return max(MAP_ALIGN, (size + MAP_ALIGN - 1) // MAP_ALIGN * MAP_ALIGN)


def digest_of(name: bytes) -> str | None:
    """The layer digest a `blobs/` entry names, or None."""
    return blob_entry(name)[0]


def blob_entry(name: bytes) -> tuple[str | None, bool]:
    """(the layer digest a `blobs/` entry names or None, whether it is the `.map` one)."""
    text = name.decode("utf-8", "replace")
    for suffix, mapped in ((SUFFIX, False), (MAP_SUFFIX, True)):
        if text.endswith(suffix) and len(text) > len(suffix):
            return text[:-len(suffix)], mapped
    return None, False


@dataclass
class LayerBlob:
    tree: LayerTree
    layout: BlobLayout

    @classmethod
    def build(cls, tree: LayerTree) -> LayerBlob:
        """The blob of a loaded layer; the layout is the one the EROFS writer
        computes from the same manifest (entries in the same order)."""
        return cls(tree, BlobLayout.build(LayerManifest(tree.entries, tree.domain)))

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def inode(self) -> int:
        # the two inode numbers a layer's range leaves free (see layers.Layers.get)
        return self.tree.base + len(self.tree.entries) + 1

    @property
    def map_inode(self) -> int:
        return self.inode + 1

    @property
    def map_size(self) -> int:
        return map_size(self.size)

    def pieces(self, offset: int, size: int) -> list[BlobPiece]:
        return self.layout.locate(offset, size)
