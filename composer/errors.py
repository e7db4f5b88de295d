"""Errors raised while converting, composing and exporting images.

Hierarchy (under chunkstore.errors.LazyfsError)::

    ComposerError
     ├── BadLayer            a layer's archive or an entry in it is unacceptable
     │    ├── UnsafePath     '..', absolute names, paths through symlinks
     │    └── BadLink        hardlink to a missing target or out of the layer
     ├── BadSource           an image reference or source that cannot be read
     ├── BadImageName        a tag that breaks the reference grammar (refs.py)
     ├── ManifestError       a stored manifest that cannot be parsed
     ├── DiffError           a sandbox's upper (or hidden paths) that cannot become a layer
     └── ImageNotFound       no image by this name or digest in the catalog

Each names the layer and, where there is one, the entry.
"""

from __future__ import annotations

from chunkstore.errors import LazyfsError


class ComposerError(LazyfsError):
    pass


class BadLayer(ComposerError):
    def __init__(self, layer: str, entry: str | None, message: str) -> None:
        self.layer = layer
        self.entry = entry
        where = f"layer {layer}" + (f", entry {entry!r}" if entry is not None else "")
        super().__init__(f"{where}: {message}")


class UnsafePath(BadLayer):
    pass


class BadLink(BadLayer):
    pass


class BadSource(ComposerError):
    pass


class BadImageName(ComposerError, ValueError):
    pass


class ManifestError(ComposerError):
    pass


class DiffError(ComposerError):
    """An upper directory or a hidden path that cannot become a layer
    (composer/snapshot.py; names what and why)."""


class ImageNotFound(ComposerError, KeyError):
    def __init__(self, name: str, why: str = "") -> None:
        super().__init__(f"no image {name!r} in the catalog{': ' + why if why else ''}")

    def __str__(self) -> str:
        return str(self.args[0])
