"""Errors raised while computing EROFS images from layer manifests.

Hierarchy (under chunkstore.errors.LazyfsError)::

    PmemError
     ├── LayoutError        a manifest that cannot be laid out (a hardlink to
     │                      nothing, an entry without a parent directory, ...)
     └── UnrepresentableEntry  an entry EROFS cannot hold as it is (a name
                               longer than 255 bytes, an xattr value over 64 KiB)

Each names the layer and, where there is one, the entry.
"""

from __future__ import annotations

from chunkstore.errors import LazyfsError


class PmemError(LazyfsError):
    pass


class LayoutError(PmemError):
    def __init__(self, layer: str, entry: str | None, message: str) -> None:
        self.layer = layer
        self.entry = entry
        where = f"layer {layer}" + (f", entry {entry!r}" if entry is not None else "")
        super().__init__(f"{where}: {message}")


class UnrepresentableEntry(LayoutError):
    pass
