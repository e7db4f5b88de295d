"""Errors of the lazyfs daemon's serving code, composed mounts and the
shared layer mounts under them.

Hierarchy::

    MountError              a composed root or a layer's shared EROFS mount
                            could not be made or removed; the message names
                            the image or layer, the path and the system error
    ServeError              the daemon could not serve what a request needs
    ├── FetchError          chunks behind a read could not be fetched (store
    │                       failure, corrupt chunk, timeout); already logged
    │                       with the layer and what was read
    └── LayerLoadFailed     a layer (or its blob layout) that another request
                            was loading at the same time failed to load

The daemon reports failures to FUSE callers as errno values (EIO, ENOENT),
never as exceptions (pyfuse3's contract): the FUSE adapter (lazyfs/fs.py)
is where ServeError becomes EIO.
"""

from __future__ import annotations


class MountError(Exception):
    """A composed mount could not be made or removed; the message says why."""


class ServeError(Exception):
    """The daemon could not serve what a request needs."""


class FetchError(ServeError):
    """Chunks behind a read could not be fetched; the message says which read."""


class LayerLoadFailed(ServeError):
    """A layer another request was loading failed to load (that request logged why)."""
