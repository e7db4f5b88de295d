"""Housekeeping of the VM backends' node-wide cache files: the pmem metadata
images (runtime/guest/pmemimages.py) and the full VMs' base disks
(runtime/guest/disk.py).

    sweep(dirs, paths)              at node start: what interrupted builds left
    collect(dirs, keep, in_use, max_age)   files of images gone, stale or unused

What a file belongs to is in its name (the one place both build it):

    PMEM/<layer key>-<fp>.meta.pmem                 a layer's metadata image
    PMEM/fixups-<image key>-<fp>.{meta,blob}.pmem   an image's fixup layer
    DISKS/<image key>-<fp>-<headroom>.{ext4,json}   an image's base disk

(key: chunkstore.digests.digest_key of the digest; fp: the fingerprint of
the code that lays the file out.) A build holds the cache's lock
(cachelock.py) from its first temporary file to the rename that publishes
the result, and writes only dot-names until then; so a sweep that gets the
lock without waiting finds only leftovers of builds whose process died: a
mount point `.mnt-*` (the image mounted to build a disk; unmounted), a
temporary file `.<name>.*`, a builder (mkfs.ext4) still writing one
(killed). If the lock is held, a build is under way and the sweep skips
that directory (the next start finds what is left).

collect removes a file when the image or layer it belongs to is no longer
in `keep` (the catalog's), when it was laid out by other code (its
fingerprint is not the current one), or when it was not used for `max_age`
seconds (cachelock.mark_used, on each use: its mtime); never a file of `in_use`
(live sandboxes': a paused VM needs its pmem files again, a full VM's
overlay names its base disk). A file is recreated when a sandbox needs it
again. Both take the cache's lock per directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lazyfs import sysmount
from lazyfs.mounts import MountError, unmount
from lazyfs.node import NodePaths

from . import disk, pmemimages

log = logging.getLogger(__name__)

LOCK = ".lock"  # cachelock.py's
PMEM_SUFFIXES = (".meta.pmem", ".blob.pmem")
DISK_SUFFIXES = (".ext4", ".json")
FIXUPS = "fixups-"


@dataclass(frozen=True)
class CacheFile:
    path: Path
    key: str           # digest_key of the layer or image it belongs to
    image: bool        # the key is an image's (fixups, disks), else a layer's
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
    for suffix in DISK_SUFFIXES:
        if name.endswith(suffix):
            parts = name[:-len(suffix)].rsplit("-", 2)
            if len(parts) == 3 and parts[2].isdigit():
                return CacheFile(path, parts[0], True, parts[1])
    return None


def current_fingerprint(f: CacheFile) -> str:
    return disk.fingerprint() if f.path.name.endswith(DISK_SUFFIXES) else \
        pmemimages.fingerprint()


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


def _builders(cache: Path) -> list[int]:
    """Processes whose command line names a file in `cache` (a builder left
    running by a node that died: mkfs.ext4 writing a temporary disk)."""
    needle = os.fsencode(cache) + b"/."
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if any(arg.startswith(needle) for arg in cmd.split(b"\0")):
            out.append(int(d))
    return out


def sweep(dirs: Iterable[Path], paths: NodePaths | None) -> list[Path]:
    """Remove what interrupted builds left in the cache directories (see the
    module docstring); returns what was removed. `paths`: the node's
    daemon, whose registry records a build's image mount."""
    removed: list[Path] = []
    for cache in _unlocked(dirs, "sweeping"):
        for pid in _builders(cache):
            log.warning("killing %d: a builder left writing into %s", pid, cache)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)
        prefix = f"{cache.resolve()}/.mnt-"
        for m in sorted((m for m in sysmount.mounts() if m.mount_point.startswith(prefix)),
                        key=lambda m: -len(m.mount_point)):
            _unmount(paths, Path(m.mount_point))
        for p in cache.iterdir():
            if not p.name.startswith(".") or p.name == LOCK:
                continue
            try:
                if p.is_dir() and not p.is_symlink():
                    if sysmount.is_mount_point(p):
                        log.warning("%s is still mounted; left for the next start", p)
                        continue
                    p.rmdir()
                else:
                    p.unlink()
            except OSError as e:
                log.warning("cannot remove the leftover %s: %s", p, e)
                continue
            log.info("removed %s, left by an interrupted build", p)
            removed.append(p)
    return removed


def _unmount(paths: NodePaths | None, mnt: Path) -> None:
    try:
        if paths is not None:
            unmount(paths, mnt, lazy=True)
        else:
            sysmount.umount(mnt, lazy=True)
    except (MountError, OSError) as e:
        with contextlib.suppress(OSError):
            sysmount.umount(mnt, lazy=True)
        log.info("unmounting %s: %s", mnt, e)


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return
        except (OSError, IndexError):
            return
        time.sleep(0.01)


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
            stale = f.fingerprint != current_fingerprint(f)
            old = max_age is not None and age > max_age
            if gone or stale or old:
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
                    log.info("collected %s (%s)", p, "image gone" if gone else
                             "laid out by other code" if stale else f"unused {age:.0f}s")
    return removed
