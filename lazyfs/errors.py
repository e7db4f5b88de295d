"""Errors of composed mounts and the shared layer mounts under them.

Hierarchy::

    MountError              a composed root or a layer's shared EROFS mount
                            could not be made or removed; the message names
                            the image or layer, the path and the system error

The daemon itself reports failures to FUSE callers as errno values (EIO,
ENOENT), never as exceptions (pyfuse3's contract).
"""

from __future__ import annotations


class MountError(Exception):
    """A composed mount could not be made or removed; the message says why."""
