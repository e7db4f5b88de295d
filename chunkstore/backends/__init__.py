"""Pack backends and the factory that picks one from a URL.

`file:///path` or a plain path: the local directory backend. The cluster
backends (SeaweedFS/S3, a shared POSIX mount) register here too.
"""

from __future__ import annotations

import os

from .base import Backend, PackWriter
from .local import LocalDirBackend

__all__ = ["Backend", "LocalDirBackend", "PackWriter", "get_backend"]


def get_backend(url: str | os.PathLike[str], *, readonly: bool = False) -> Backend:
    text = os.fspath(url)
    if text.startswith("file://"):
        return LocalDirBackend(text[len("file://"):], readonly=readonly)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise ValueError(f"unknown chunk backend scheme {scheme!r} in {text!r} (known: file)")
    return LocalDirBackend(text, readonly=readonly)
