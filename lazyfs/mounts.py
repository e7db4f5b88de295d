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

from composer.catalog import Image, ImageCatalog
from composer.compose import overlay_fixups
from composer.manifest import Entry, LayerManifest

from . import sysmount
from .daemon import NodePaths, request
from .tree import is_overlay_xattr

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
        if not is_overlay_xattr(name):  # an image must not steer overlayfs
            os.setxattr(target, name, value, follow_symlinks=False)
    os.chmod(target, e.mode)
    os.utime(target, ns=(e.mtime_ns, e.mtime_ns))


def write_fixups(dest: Path, entries: list[Entry]) -> None:
    """Create the fixup directories under dest with their composed metadata.
    Paths come from manifests (checked when they were parsed); they are
    checked again here, and no component may be an existing symlink."""
    dest.mkdir(parents=True, exist_ok=True)
    for e in entries:
        parts = e.path.split("/") if e.path else []
        if any(p in ("", ".", "..") for p in parts):
            raise MountError(f"unsafe directory path in the image: {e.path!r}")
        d = dest
        for p in parts:
            d = d / p
            if d.is_symlink():
                raise MountError(f"{d} is a symlink; refusing to write through it")
            d.mkdir(exist_ok=True)
    for e in reversed(entries):  # children first: creating them touched parents' mtimes
        _apply(dest / e.path if e.path else dest, e)


def _fixup_layer(paths: NodePaths, image_digest: str, entries: list[Entry]) -> Path:
    dest = paths.fixups / image_digest.replace(":", "-")
    if (dest / ".complete").exists():
        return dest / "tree"
    tmp = paths.fixups / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        write_fixups(tmp / "tree", entries)
        (tmp / ".complete").touch()
        os.rename(tmp, dest)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if (dest / ".complete").exists():  # someone else made it first
            return dest / "tree"
        raise MountError(f"cannot write the directory fixups of {image_digest}: {e}") from e
    return dest / "tree"


def _effective_layers(layers: list[LayerManifest], digests: list[str]
                      ) -> tuple[list[LayerManifest], list[str]]:
    """overlayfs never looks up a layer's root, so an opaque root marker would
    be ignored: a layer whose root is opaque hides every layer below it, so
    those are left out of the mount."""
    start = 0
    for i, m in enumerate(layers):
        root = next((e for e in m.entries if e.path == ""), None)
        if i > 0 and root is not None and root.opaque:
            start = i
    return layers[start:], digests[start:]


def _escape(path: Path) -> str:
    # overlayfs splits lowerdir on ':' and unescapes '\'
    return str(path).replace("\\", "\\\\").replace(":", "\\:").replace(",", "\\,")


def mount_image(paths: NodePaths, catalog: ImageCatalog, name: str, mountpoint: Path, *,
                writable: Path | None = None, allow_devices: bool = False) -> ComposedMount:
    """Mount image `name` (catalog name or digest) composed at `mountpoint`.
    The daemon must be running. Undone completely on failure.

    The mount is nosuid and nodev unless allow_devices: an image is content
    somebody else chose, and its setuid binaries and device nodes must not
    work for users of this host (a container runtime that confines them in
    its own namespaces may allow them)."""
    if not paths.layers.is_dir():
        raise MountError(f"no lazyfs daemon serving {paths.mnt}")
    digest, image = catalog.resolve(name)
    mountpoint = Path(os.path.realpath(mountpoint))
    if not mountpoint.is_dir():
        raise MountError(f"mount point {mountpoint} is not a directory")
    if sysmount.find_mount(mountpoint) is not None:
        raise MountError(f"{mountpoint} is already a mount point")
    manifests, layer_digests = _effective_layers(
        [catalog.load_layer(d) for d in image.layers], list(image.layers))
    lowers = [paths.layers / d for d in reversed(layer_digests)]
    for low in lowers:  # loads each layer's manifest in the daemon: metadata only
        if not low.is_dir():
            raise MountError(f"layer {low.name} of {name} is not served by the daemon")
    fixups = overlay_fixups(manifests)
    flags = 0 if allow_devices else sysmount.MS_NOSUID | sysmount.MS_NODEV
    if writable is not None:
        writable = Path(os.path.realpath(writable))
        upper, work = writable / "upper", writable / "work"
        done = writable / ".lazyfs-fixups"
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        if not done.exists():  # a new writable layer: fixups first, then the marker
            try:
                write_fixups(upper, fixups)
            except OSError as e:
                raise MountError(f"cannot write directory fixups into {upper}: {e}") from e
            done.write_text(digest + "\n")
        data = (f"lowerdir={':'.join(_escape(p) for p in lowers)},"
                f"upperdir={_escape(upper)},workdir={_escape(work)}")
    else:
        top = _fixup_layer(paths, digest, fixups)
        data = f"lowerdir={':'.join(_escape(p) for p in [top, *lowers])}"
        flags |= sysmount.MS_RDONLY
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
    mountpoint = Path(os.path.realpath(mountpoint))
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
    try:  # its per-mount counters go with it (the per-layer ones stay)
        request(paths, {"op": "forget_mount", "mount": str(mountpoint)}, timeout=2.0)
    except (OSError, ConnectionError, ValueError, RuntimeError):
        pass


def registered(paths: NodePaths) -> list[dict[str, object]]:
    out = []
    for f in sorted(paths.mounts.glob("*.json")) if paths.mounts.is_dir() else []:
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def image_of(catalog: ImageCatalog, name: str) -> tuple[str, Image]:
    return catalog.resolve(name)
