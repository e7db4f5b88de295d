"""Composed roots: kernel overlayfs over the daemon's layer trees.

    root = mount_image(paths, catalog, "debian:12", Path("/tmp/root"), writable=Path("/tmp/rw"))
    ...
    unmount(paths, Path("/tmp/root"))

lower = the image's layer trees, top layer first (toolkits over workspace over
base) as the daemon serves them under ROOT/mnt/layers/<digest>; upper = the
sandbox's own directory (WRITABLE/upper, WRITABLE/work) on local disk, or,
read-only, nothing. overlayfs honours the whiteouts and opaque directories the
trees present. Directory metadata that overlayfs would take from an upper
layer which only implied a directory is fixed by placing those directories,
with the composed metadata, above the layers: in the writable upper when it
is new, else in a per-image metadata-only top layer (ROOT/fixups/<image>).
Mounting reads manifests only: no file data is fetched before the first read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from composer.catalog import Catalog, Image
from composer.compose import overlay_fixups
from composer.manifest import Entry

from . import sysmount
from .daemon import NodePaths

MAX_OPTIONS = 4000  # overlayfs mount data is one page


class MountError(Exception):
    """A composed mount could not be made or removed; the message says why."""


@dataclass(frozen=True)
class ComposedMount:
    mountpoint: Path
    image: str
    layers: list[str]
    writable: Path | None


def _reg_path(paths: NodePaths, mountpoint: Path) -> Path:
    key = hashlib.sha256(str(mountpoint).encode()).hexdigest()[:24]
    return paths.mounts / f"{key}.json"


def _apply(target: Path, e: Entry) -> None:
    os.lchown(target, e.uid, e.gid)
    for name, value in e.xattrs.items():
        os.setxattr(target, name, value, follow_symlinks=False)
    os.chmod(target, e.mode)
    os.utime(target, ns=(e.mtime_ns, e.mtime_ns))


def write_fixups(dest: Path, entries: list[Entry]) -> None:
    """Create the fixup directories under dest with their composed metadata."""
    dest.mkdir(parents=True, exist_ok=True)
    for e in entries:
        if e.path:
            (dest / e.path).mkdir(exist_ok=True)
    for e in reversed(entries):  # children first: creating them touched parents' mtimes
        _apply(dest / e.path if e.path else dest, e)


def _fixup_layer(paths: NodePaths, image_digest: str, entries: list[Entry]) -> Path:
    dest = paths.fixups / image_digest.replace(":", "-")
    if (dest / ".complete").exists():
        return dest / "tree"
    tmp = paths.fixups / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
    write_fixups(tmp / "tree", entries)
    (tmp / ".complete").touch()
    try:
        os.rename(tmp, dest)
    except OSError:  # someone else made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "tree"


def _escape(path: Path) -> str:
    # overlayfs splits lowerdir on ':' and unescapes '\'
    return str(path).replace("\\", "\\\\").replace(":", "\\:").replace(",", "\\,")


def mount_image(paths: NodePaths, catalog: Catalog, name: str, mountpoint: Path, *,
                writable: Path | None = None) -> ComposedMount:
    """Mount image `name` (catalog name or digest) composed at `mountpoint`.
    The daemon must be running. Undone completely on failure."""
    if not paths.layers.is_dir():
        raise MountError(f"no lazyfs daemon serving {paths.mnt}")
    digest, image = catalog.resolve(name)
    mountpoint = mountpoint.absolute()
    if not mountpoint.is_dir():
        raise MountError(f"mount point {mountpoint} is not a directory")
    if sysmount.find_mount(mountpoint) is not None:
        raise MountError(f"{mountpoint} is already a mount point")
    lowers = [paths.layers / d for d in reversed(image.layers)]
    for low in lowers:  # loads each layer's manifest in the daemon: metadata only
        if not low.is_dir():
            raise MountError(f"layer {low.name} of {name} is not served by the daemon")
    fixups = overlay_fixups([catalog.load_layer(d) for d in image.layers])
    if writable is not None:
        writable = writable.absolute()
        upper, work = writable / "upper", writable / "work"
        fresh = not upper.exists() or not any(upper.iterdir())
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        if fresh:
            write_fixups(upper, fixups)
        data = (f"lowerdir={':'.join(_escape(p) for p in lowers)},"
                f"upperdir={_escape(upper)},workdir={_escape(work)}")
        flags = 0
    else:
        top = _fixup_layer(paths, digest, fixups)
        data = f"lowerdir={':'.join(_escape(p) for p in [top, *lowers])}"
        flags = sysmount.MS_RDONLY
    if len(data) > MAX_OPTIONS:
        raise MountError(f"{name}: {len(image.layers)} layers make overlayfs options of "
                         f"{len(data)} bytes (limit {MAX_OPTIONS}); use a shorter daemon root")
    try:
        sysmount.mount("overlay", mountpoint, "overlay", flags, data)
    except OSError as e:
        raise MountError(f"overlayfs mount of {name} on {mountpoint} failed: {e.strerror} "
                         "(see dmesg)") from e
    reg = ComposedMount(mountpoint, digest, list(image.layers), writable)
    _reg_path(paths, mountpoint).write_text(json.dumps(
        {"mountpoint": str(mountpoint), "image": digest, "name": name,
         "layers": image.layers, "writable": str(writable) if writable else None}))
    return reg


def unmount(paths: NodePaths, mountpoint: Path, *, lazy: bool = False) -> None:
    mountpoint = mountpoint.absolute()
    info = sysmount.find_mount(mountpoint)
    if info is None:
        _reg_path(paths, mountpoint).unlink(missing_ok=True)
        raise MountError(f"{mountpoint} is not mounted")
    try:
        sysmount.umount(mountpoint, lazy=lazy)
    except OSError as e:
        hint = " (in use: close what runs there, or use --lazy)" if e.errno == 16 else ""
        raise MountError(f"cannot unmount {mountpoint}: {e.strerror}{hint}") from e
    _reg_path(paths, mountpoint).unlink(missing_ok=True)


def registered(paths: NodePaths) -> list[dict[str, object]]:
    out = []
    for f in sorted(paths.mounts.glob("*.json")) if paths.mounts.is_dir() else []:
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def image_of(catalog: Catalog, name: str) -> tuple[str, Image]:
    return catalog.resolve(name)
