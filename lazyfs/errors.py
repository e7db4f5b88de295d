"""Errors of the node: its settings, its lazyfs daemon, composed mounts and
the shared layer mounts under them.

Hierarchy (under chunkstore.errors.LazyfsError)::

    NodeError               base of the lazyfs package's errors
     ├── ConfigError        a setting is invalid: the config file cannot be
     │                      read, has an unknown section or key, or a value
     │                      (from the file, the environment or an option) has
     │                      the wrong type; the message names where it came from
     ├── DaemonError        the node's lazyfs daemon could not be started,
     │                      did not answer in time, did not stop, serves another
     │                      store, or refused a control request
     └── MountError         a composed root or a layer's shared EROFS mount
                            could not be made or removed; the message names
                            the image or layer, the path and the system error
    ServeError              the daemon could not serve what a request needs
    ├── FetchError          chunks behind a read could not be fetched (store
    │                       failure, corrupt chunk, timeout); already logged
    │                       with the layer and what was read
    └── LayerLoadFailed     a layer (or its blob layout) that another request
                            was loading at the same time failed to load

The daemon itself reports failures to FUSE callers as errno values (EIO,
ENOENT), never as exceptions (pyfuse3's contract): the FUSE adapter
(lazyfs/fs.py) is where ServeError becomes EIO. Importing this module is
light (no pyfuse3, trio or LMDB): the settings use it in SDK processes.
"""

from __future__ import annotations

from chunkstore.errors import LazyfsError


class NodeError(LazyfsError):
    """Base class of the node's errors (settings, daemon, mounts)."""


class ConfigError(NodeError):
    """An invalid setting; the message says where it came from."""


class DaemonError(NodeError):
    """The node's lazyfs daemon failed to start, answer, stop or serve a request."""


class MountError(NodeError):
    """A composed mount could not be made or removed; the message says why."""


class ServeError(Exception):
    """The daemon could not serve what a request needs."""


class FetchError(ServeError):
    """Chunks behind a read could not be fetched; the message says which read."""


class LayerLoadFailed(ServeError):
    """A layer another request was loading failed to load (that request logged why)."""
