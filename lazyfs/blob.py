"""A layer's data as one flat, read-only file: the blob that the layer's
EROFS image (pmem/erofs.py) names as its data device, served by the daemon
as `blobs/<digest>.data`.

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


def blob_name(digest: str) -> str:
    return digest + SUFFIX


def digest_of(name: bytes) -> str | None:
    """The layer digest a `blobs/` entry names, or None."""
    text = name.decode("utf-8", "replace")
    return text[:-len(SUFFIX)] if text.endswith(SUFFIX) and len(text) > len(SUFFIX) else None


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
        # the one inode number a layer's range leaves free (see layers.Layers.get)
        return self.tree.base + len(self.tree.entries) + 1

    def pieces(self, offset: int, size: int) -> list[BlobPiece]:
        return self.layout.locate(offset, size)
