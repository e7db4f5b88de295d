"""Housekeeping of the VM backends' node-wide cache files: the pmem metadata
images (runtime/guest/pmemimages.py) both VM backends map.

    sweep(dirs)                     at node start: what interrupted builds left
    collect(dirs, keep, in_use, max_age)   files of images gone, stale or unused

What a file belongs to is in its name (the one place both build it):

    PMEM/<layer key>-<fp>.meta.pmem                 a layer's metadata image
    PMEM/fixups-<image key>-<fp>.{meta,blob}.pmem   an image's fixup layer

(key: chunkstore.digests.digest_key of the digest; fp: the fingerprint of
the code that lays the file out.) A build holds the cache's lock
(cachelock.py) from its first temporary file to the rename that publishes
the result, and writes only dot-names until then; so a sweep that gets the
lock without waiting finds only leftovers of builds whose process died:
temporary files `.<name>.*`. If the lock is held, a build is under way and
the sweep skips that directory (the next start finds what is left).

collect removes a file when the image or layer it belongs to is no longer
in `keep` (the catalog's), when it was laid out by other code (its
fingerprint is not the current one), or when it was not used for `max_age`
seconds (cachelock.mark_used, on each use: its mtime); never a file of `in_use`
(live sandboxes': a paused VM needs its pmem files again). A file is
recreated when a sandbox needs it again. Both take the cache's lock per
directory.

A full VM's writable disk is its sandbox's (vm/upper.ext4), made empty per
sandbox and removed with it: nothing of it is cached here.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from . import pmemimages

log = logging.getLogger(__name__)

LOCK = ".lock"  # cachelock.py's
PMEM_SUFFIXES = (".meta.pmem", ".blob.pmem")
FIXUPS = "fixups-"


@dataclass(frozen=True)
class CacheFile:
    path: Path
    key: str           # digest_key of the layer or image it belongs to
    image: bool        # the key is an image's (fixups), else a layer's
    fingerprint: str


def parse(path: Path) -> CacheFile | None:
    """What a cache file belongs to, from its name (None: not one of ours)."""
    name = path.name
    if name.startswith("."):
        return None
    for suffix in PMEM_SUFFIXES:
        if name.endswith(suffix):
            stem = name[:-len(suffix)]
            image = stem.startswith(FIXUPS)
            key, _, fp = stem.removeprefix(FIXUPS).rpartition("-")
            return CacheFile(path, key, image, fp) if key and fp else None
    return None


def _unlocked(dirs: Iterable[Path], doing: str) -> Iterator[Path]:
    """Each existing cache directory, its lock held while the caller works
    on it; a directory whose lock another process holds (a build under way)
    is skipped at once."""
    for cache in dirs:
        if not cache.is_dir():
            continue
        try:
            fd = os.open(cache / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            log.warning("not %s %s: %s", doing, cache, e)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("not %s %s: a build holds its lock", doing, cache)
                continue
            yield cache
        finally:
            os.close(fd)


def sweep(dirs: Iterable[Path]) -> list[Path]:
    """Remove what interrupted builds left in the cache directories (see the
    module docstring); returns what was removed."""
    removed: list[Path] = []
    for cache in _unlocked(dirs, "sweeping"):
        for p in cache.iterdir():
            if not p.name.startswith(".") or p.name == LOCK:
                continue
            try:
                p.unlink()
            except OSError as e:
                log.warning("cannot remove the leftover %s: %s", p, e)
                continue
            log.info("removed %s, left by an interrupted build", p)
            removed.append(p)
    return removed


def collect(dirs: Iterable[Path], keep: set[str], in_use: set[str],
            max_age: float | None = None, now: float | None = None) -> list[Path]:
    """Remove the cache files that belong to no digest of `keep` (layer and
    image digests, as digest_key gives them), that another version of the
    code laid out, or (max_age) unused for longer; never those of `in_use`.
    Returns what was removed."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    for cache in _unlocked(dirs, "collecting"):
        for p in sorted(cache.iterdir()):
            f = parse(p)
            if f is None or f.key in in_use:
                continue
            try:
                age = now - p.stat().st_mtime
            except OSError:
                continue
            gone = f.key not in keep
            stale = f.fingerprint != pmemimages.fingerprint()
            old = max_age is not None and age > max_age
            if gone or stale or old:
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
                    log.info("collected %s (%s)", p, "image gone" if gone else
                             "laid out by other code" if stale else f"unused {age:.0f}s")
    return removed
