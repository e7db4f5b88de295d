"""One lock for the node-wide caches the guest parts fill (kernel, pmem
images): several node processes may build the same entry at once."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


@contextmanager
def locked(cache: Path) -> Iterator[None]:
    """Hold cache/.lock (creating the directory) for the block."""
    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def mark_used(path: Path) -> None:
    """A cache file is used now: caches.collect counts its age from here."""
    with suppress(OSError):
        os.utime(path)
