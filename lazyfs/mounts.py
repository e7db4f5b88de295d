"""Composed roots: kernel overlayfs over the image's layers.

    root = mount_image(paths, catalog, "debian:12", Path("/tmp/root"), writable=Path("/tmp/rw"))
    ...
    unmount(paths, Path("/tmp/root"))

lower = the image's layers, top layer first (toolkits over workspace over
base), each either

- kernel path (default, `KERNEL_DEFAULT`): the layer's shared kernel EROFS
  mount, ROOT/erofs-mnt/<digest>, whose metadata image is local and whose
  data device is the daemon's blob (erofsmounts.py): lookups, stat, readdir
  and xattrs run in the kernel, Python sees only cold data reads; or
- FUSE path (`kernel=False`, `lazyfs mount --fuse`): the layer tree the daemon
  serves under ROOT/mnt/layers/<digest>;

upper = the sandbox's own directory (WRITABLE/upper, WRITABLE/work) on local
disk, or, read-only, nothing. overlayfs honours the whiteouts (char 0/0) and
opaque directories (trusted.overlay.opaque=y) both kinds of lower present. Directory metadata that overlayfs would take from an upper
layer which only implied a directory is fixed by placing those directories,
with the composed metadata, above the layers: in the writable upper when it
is new, else in a per-image metadata-only top layer (ROOT/fixups/<image>).
Mounting reads manifests only: no file data is fetched before the first read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from chunkstore.digests import digest_key
from composer.catalog import Image, ImageCatalog
from composer.compose import mount_layers, overlay_fixups
from composer.errors import ComposerError
from composer.manifest import Entry, LayerManifest
from pmem.errors import PmemError

from . import erofsmounts, sysmount
from .errors import DaemonError, MountError
from .node import NodePaths, end_daemon, request
from .tree import is_overlay_xattr

__all__ = ["KERNEL_DEFAULT", "ComposedMount", "IdShift", "MountError", "mount_image",
           "registered", "unmount", "write_fixups"]

log = logging.getLogger(__name__)

MAX_OPTIONS = 4000  # overlayfs mount data is one page
# Composed roots use the layers' kernel EROFS mounts as lowers unless told
# otherwise: benchmarks/bench_erofs.py measured metadata work at kernel speed
# there (docs/erofs.md has the figures). False falls back to the FUSE trees.
KERNEL_DEFAULT = True


@dataclass(frozen=True)
class IdShift:
    """A composed root for processes whose ids are host ids `base` and up (a
    container's user namespace maps its 0..N to base..base+N): each lower is
    an idmapped copy of its mount through `userns_fd` (a user namespace
    with that map), so the image's root-owned files show as owned by `base`
    and look root-owned inside; the writable layer holds host ids as they
    are (what the sandbox's processes write is owned by base+N on the host),
    its root and directory fixups written shifted by `base`."""

    userns_fd: int
    base: int


@dataclass(frozen=True)
class ComposedMount:
    mountpoint: Path
    image: str
    layers: list[str]
    writable: Path | None
    kernel: bool = False  # lowers are the layers' shared EROFS mounts


def _reg_path(paths: NodePaths, mountpoint: Path) -> Path:
    return paths.mounts / f"{erofsmounts.user_key(mountpoint)}.json"


def _apply(target: Path, e: Entry, id_base: int) -> None:
    os.lchown(target, id_base + e.uid, id_base + e.gid)
    for name, value in e.xattrs.items():
        if not is_overlay_xattr(name):  # an image must not steer overlayfs
            os.setxattr(target, name, value, follow_symlinks=False)
    os.chmod(target, e.mode)
    os.utime(target, ns=(e.mtime_ns, e.mtime_ns))


def write_fixups(dest: Path, entries: list[Entry], id_base: int = 0) -> None:
    """Create the fixup directories under dest with their composed metadata
    (owners shifted by id_base: IdShift).
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
        _apply(dest / e.path if e.path else dest, e, id_base)


def _fixup_layer(paths: NodePaths, image_digest: str,
                 entries: Callable[[], list[Entry]]) -> Path:
    dest = paths.fixups / digest_key(image_digest)
    if (dest / ".complete").exists():
        return dest / "tree"
    tmp = paths.fixups / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        write_fixups(tmp / "tree", entries())
        (tmp / ".complete").touch()
        os.rename(tmp, dest)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if (dest / ".complete").exists():  # someone else made it first
            return dest / "tree"
        raise MountError(f"cannot write the directory fixups of {image_digest}: {e}") from e
    return dest / "tree"


def _escape(path: Path) -> str:
    # overlayfs splits lowerdir on ':' and unescapes '\'
    return str(path).replace("\\", "\\\\").replace(":", "\\:").replace(",", "\\,")


@contextlib.contextmanager
def _layer_names(lowers: list[Path], others: list[Path], hide: bool,
                 idmap: IdShift | None = None) -> Iterator[list[str]]:
    """The overlay option strings naming lowers + others: their escaped
    paths, or (hide, or idmap) /proc/self/fd/N of descriptors open while the
    context lasts: O_PATH ones, or for lowers under idmap their idmapped
    copies."""
    dirs = lowers + others
    if not hide and idmap is None:
        yield [_escape(d) for d in dirs]
        return
    fds: list[int] = []
    try:
        for i, d in enumerate(dirs):
            if idmap is not None and i < len(lowers):
                try:
                    fds.append(sysmount.idmapped_tree(d, idmap.userns_fd))
                except OSError as e:
                    raise MountError(f"cannot idmap the layer mount {d}: {e.strerror} "
                                     "(the kernel must allow idmapped mounts of it)") from e
            elif hide:
                fds.append(os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            else:
                fds.append(-1)
        yield [f"/proc/self/fd/{fd}" if fd >= 0 else _escape(d) for fd, d in zip(fds, dirs)]
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def mount_image(paths: NodePaths, catalog: ImageCatalog, name: str, mountpoint: Path, *,
                writable: Path | None = None, allow_devices: bool = False,
                kernel: bool | None = None, hide_paths: bool = False,
                idmap: IdShift | None = None) -> ComposedMount:
    """Mount image `name` (catalog name or digest) composed at `mountpoint`.
    The daemon must be running. Undone completely on failure.

    kernel: True = the layers' shared kernel EROFS mounts as lowers, False =
    the daemon's FUSE trees, None = KERNEL_DEFAULT, falling back to the FUSE
    trees (with a warning) where the kernel has no EROFS or a layer cannot
    be an EROFS image.

    The mount is nosuid and nodev unless allow_devices: an image is content
    somebody else chose, and its setuid binaries and device nodes must not
    work for users of this host (a container runtime that confines them in
    its own namespaces may allow them). The shared EROFS mounts are always
    nosuid,nodev; the composed mount's flags are the ones that count.

    hide_paths: name the layers in the overlay's options as /proc/self/fd/N
    (descriptors held for the mount call only) instead of their host paths,
    so /proc/self/mountinfo inside a sandbox on this root says nothing about
    the host's directories; the registry still records which layers it has.

    idmap: the root of processes in a user namespace whose ids are host ids
    idmap.base and up (IdShift)."""
    if not paths.layers.is_dir():
        raise MountError(f"no lazyfs daemon serving {paths.mnt}")
    digest, image = catalog.resolve(name)
    mountpoint = Path(os.path.realpath(mountpoint))
    if not mountpoint.is_dir():
        raise MountError(f"mount point {mountpoint} is not a directory")
    if sysmount.is_mount_point(mountpoint):
        raise MountError(f"{mountpoint} is already a mount point")
    load = _Manifests(catalog)  # each manifest deserialised once per mount, if at all
    layer_digests = _mount_layers(paths, load, digest, image)

    def fixups() -> list[Entry]:  # needs every manifest: only for a new fixup layer
        return list(_composition(load, digest, image).fixups)
    use_kernel = _kernel_ready(paths, load, name, layer_digests, kernel)
    if not use_kernel:
        for low in (paths.layers / d for d in layer_digests):
            if not low.is_dir():  # loads the layer's manifest in the daemon: metadata only
                raise MountError(f"layer {low.name} of {name} is not served by the daemon")
    flags = 0 if allow_devices else sysmount.MS_NOSUID | sysmount.MS_NODEV
    if writable is not None:
        writable = Path(os.path.realpath(writable))
        upper, work = writable / "upper", writable / "work"
        done = writable / ".lazyfs-fixups"
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        if not done.exists():  # a new writable layer: fixups first, then the marker
            try:
                if idmap is not None:  # the root's owner, unless a fixup says otherwise
                    os.chown(upper, idmap.base, idmap.base)
                write_fixups(upper, fixups(), idmap.base if idmap is not None else 0)
            except OSError as e:
                raise MountError(f"cannot write directory fixups into {upper}: {e}") from e
            done.write_text(digest + "\n")
        above: list[Path] = []
        rw_dirs: list[Path] = [upper, work]
    else:
        above, rw_dirs = [_fixup_layer(paths, digest, fixups)], []
        flags |= sysmount.MS_RDONLY
    # the shared EROFS mounts are looked up, made, and counted (in their user
    # index, and in the registry file written below) under one lock, so a
    # concurrent unmount never takes down a layer mount this root is about to
    # be made on
    with erofsmounts.locked(paths) if use_kernel else contextlib.nullcontext():
        try:
            if use_kernel:
                lowers = list(reversed(erofsmounts.acquire(paths, layer_digests)))
                # counted before the overlay exists: a crash in between leaves
                # a user that is not mounted, which the next release drops
                erofsmounts.add_user(paths, layer_digests, mountpoint)
            else:
                lowers = [paths.layers / d for d in reversed(layer_digests)]
            with _layer_names(above + lowers, rw_dirs, hide_paths, idmap) as names:
                data = "lowerdir=" + ":".join(names[:len(above) + len(lowers)])
                if rw_dirs:
                    data += f",upperdir={names[-2]},workdir={names[-1]}"
                if len(data) > MAX_OPTIONS:
                    raise MountError(f"{name}: {len(image.layers)} layers make overlayfs "
                                     f"options of {len(data)} bytes (limit {MAX_OPTIONS}); "
                                     "use a shorter daemon root")
                try:
                    sysmount.mount("overlay", mountpoint, "overlay", flags, data)
                except OSError as e:
                    raise MountError(f"overlayfs mount of {name} on {mountpoint} failed: "
                                     f"{e.strerror} (see dmesg)") from e
            try:
                _register(paths, mountpoint, {
                    "mountpoint": str(mountpoint), "image": digest, "name": name,
                    "layers": image.layers, "writable": str(writable) if writable else None,
                    "lowers": "kernel" if use_kernel else "fuse",
                    "erofs_layers": layer_digests if use_kernel else []})
            except OSError as e:
                sysmount.umount(mountpoint, lazy=True)
                raise MountError(f"cannot register the mount of {name} on {mountpoint}: "
                                 f"{e}") from e
        except (MountError, OSError) as e:
            if use_kernel:
                erofsmounts.release(paths, layer_digests, mountpoint)
            if isinstance(e, MountError):
                raise
            raise MountError(f"cannot mount {name} on {mountpoint}: {e}") from e
    _announce(paths, digest, mountpoint, use_kernel)
    return ComposedMount(mountpoint, digest, list(image.layers), writable, use_kernel)


def _announce(paths: NodePaths, digest: str, mountpoint: Path, kernel: bool) -> None:
    """Tell the daemon a root of the image is up, so it records the image's
    first use or prefetches its stored trace (lazyfs.autotrace) and, on the
    kernel path, attributes the root's opens to it (lazyfs.opens). Best
    effort: a daemon that cannot answer costs the mount nothing."""
    try:
        request(paths, {"op": "mounted", "image": digest, "mount": str(mountpoint),
                        "kernel": kernel}, timeout=2.0)
    except (OSError, DaemonError) as e:
        log.debug("daemon not told of the mount of %s on %s: %s", digest, mountpoint, e)


def _kernel_ready(paths: NodePaths, load: _Manifests, name: str, layers: list[str],
                  kernel: bool | None) -> bool:
    """Whether this mount takes the kernel path; fetches the layers' metadata
    images where missing from the catalog (stored with the layer when it was
    converted, checked against the digest the layer's record names), else
    builds them (outside the lock: they are deterministic and atomic; the
    manifests are loaded only for those built)."""
    if not (KERNEL_DEFAULT if kernel is None else kernel):
        return False
    try:
        if not erofsmounts.available():
            raise MountError("this kernel has no EROFS (CONFIG_EROFS_FS)")
        missing = [d for d in layers if not erofsmounts.image_path(paths, d).exists()]
        missing = [d for d in missing if not erofsmounts.fetch_image(paths, load.catalog, d)]
        if missing:
            erofsmounts.build_images(paths, {d: load(d) for d in missing})
    except (MountError, PmemError, OSError) as e:
        if kernel:
            raise MountError(f"kernel path for {name}: {e}") from e
        log.warning("%s: kernel EROFS path unavailable (%s); using the FUSE trees", name, e)
        return False
    return True


@dataclass(frozen=True)
class _Composed:
    """What mounting an image needs of its manifests: the layers the mount
    uses (top ones first after an opaque root) and the directory fixups."""

    layers: tuple[str, ...]
    fixups: tuple[Entry, ...]


# image digest -> its composition. Content-addressed (a digest names its
# layers, their manifests and so the composition forever), so an entry never
# goes stale; bounded, and holding no manifests (those can be large).
COMPOSITION_CACHE = 64
_compositions: OrderedDict[str, _Composed] = OrderedDict()
_compositions_lock = threading.Lock()


class _Manifests:
    """A catalog's layer manifests for one mount: each loaded on first use
    and kept while the mount is being made (the composition and the EROFS
    metadata images both need them)."""

    def __init__(self, catalog: ImageCatalog) -> None:
        self.catalog = catalog
        self._loaded: dict[str, LayerManifest] = {}

    def __call__(self, digest: str) -> LayerManifest:
        m = self._loaded.get(digest)
        if m is None:
            m = self._loaded[digest] = self.catalog.load_layer(digest)
        return m


def _composition(load: _Manifests, digest: str, image: Image) -> _Composed:
    with _compositions_lock:
        hit = _compositions.get(digest)
        if hit is not None:
            _compositions.move_to_end(digest)
            return hit
    try:
        stored = load.catalog.load_composition(digest)
    except ComposerError as e:
        log.warning("%s; composing the image from its manifests", e)
        stored = None
    if stored is not None:
        comp = _Composed(tuple(stored[0]), tuple(stored[1]))
    else:
        manifests, layer_digests = mount_layers(
            [load(d) for d in image.layers], list(image.layers))
        comp = _Composed(tuple(layer_digests), tuple(overlay_fixups(manifests)))
    with _compositions_lock:
        _compositions[digest] = comp
        while len(_compositions) > COMPOSITION_CACHE:
            _compositions.popitem(last=False)
    return comp


def _mount_layers(paths: NodePaths, load: _Manifests, digest: str, image: Image
                  ) -> list[str]:
    """The layers a root of the image is made of, lowest first: from this
    process's composition cache, else from the node's record of the image
    (ROOT/compositions/<image>.json, written the first time: a mount of an
    image the node has mounted before reads no manifest), else from the
    manifests. A record that is not a suffix of the image's layers (the
    opaque-root rule only ever drops lower ones) is ignored and rewritten."""
    with _compositions_lock:
        hit = _compositions.get(digest)
    if hit is not None:
        return list(hit.layers)
    path = paths.compositions / f"{digest_key(digest)}.json"
    try:
        layers = json.loads(path.read_text())["layers"]
        if (isinstance(layers, list) and layers and all(isinstance(d, str) for d in layers)
                and list(image.layers[len(image.layers) - len(layers):]) == layers):
            return list(layers)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    layers = list(_composition(load, digest, image).layers)
    try:
        paths.compositions.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
        try:
            tmp.write_text(json.dumps({"image": digest, "layers": layers}))
            os.rename(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:  # the next mount reads the manifests again
        log.debug("cannot record the composition of %s: %s", digest, e)
    return layers


def _register(paths: NodePaths, mountpoint: Path, record: dict[str, object]) -> None:
    path = _reg_path(paths, mountpoint)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def detach(paths: NodePaths, mountpoint: Path, holder_pid: int) -> None:
    """Take a composed root out of this mount namespace while process
    holder_pid (a container's init, whose mount namespace has its own copy of
    the mount) keeps using it: the host's mount table stays the same size
    however many sandboxes run. The layers count the root as a user while the
    holder lives; `unmount` of a held root releases it (nothing to unmount)."""
    mountpoint = Path(os.path.realpath(mountpoint))
    start = erofsmounts.process_start(holder_pid)
    if start is None:
        raise MountError(f"cannot hand {mountpoint} to process {holder_pid}: it is gone")
    with erofsmounts.locked(paths):
        reg = _reg_path(paths, mountpoint)
        try:
            record = json.loads(reg.read_text())
        except (OSError, ValueError) as e:
            raise MountError(f"{mountpoint} is not a registered composed root: {e}") from e
        record["holder"] = {"pid": holder_pid, "start": start}
        _register(paths, mountpoint, record)
        layers = [str(d) for d in record.get("erofs_layers") or []]
        erofsmounts.set_holder(paths, layers, mountpoint, holder_pid, start)
        try:
            sysmount.umount(mountpoint, lazy=True)
        except OSError as e:
            raise MountError(f"cannot detach {mountpoint}: {e.strerror}") from e


def unmount(paths: NodePaths, mountpoint: Path, *, lazy: bool = False) -> None:
    """Unmount a composed root and release the shared EROFS mounts of its
    layers no other mounted root uses (those of layers it did not use, a
    crashed user's included, go at the next sweep: daemon start or stop)."""
    mountpoint = Path(os.path.realpath(mountpoint))
    with erofsmounts.locked(paths):
        layers = _registered_layers(paths, mountpoint)
        if not sysmount.is_mount_point(mountpoint):
            held = _is_held(paths, mountpoint)
            _reg_path(paths, mountpoint).unlink(missing_ok=True)
            _release(paths, layers, mountpoint)
            if held:  # detached: the holder's end ended its use
                _forget(paths, mountpoint)
                return
            raise MountError(f"{mountpoint} is not mounted")
        try:
            try:
                sysmount.umount(mountpoint, lazy=lazy)
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                # open events the daemon has not read yet hold the mount
                # (lazyfs.opens): its watch goes first, then once more
                _forget(paths, mountpoint)
                sysmount.umount(mountpoint, lazy=lazy)
        except OSError as e:
            hint = " (in use: close what runs there, or use --lazy)" if e.errno == 16 else ""
            raise MountError(f"cannot unmount {mountpoint}: {e.strerror}{hint}") from e
        _reg_path(paths, mountpoint).unlink(missing_ok=True)
        _release(paths, layers, mountpoint)
    _forget(paths, mountpoint)  # its per-mount counters go with it (the per-layer ones stay)


def _forget(paths: NodePaths, mountpoint: Path) -> None:
    try:
        request(paths, {"op": "forget_mount", "mount": str(mountpoint)}, timeout=2.0)
    except (OSError, DaemonError):
        pass


def _is_held(paths: NodePaths, mountpoint: Path) -> bool:
    """Whether the registry record says a process held the root (detach)."""
    try:
        return "holder" in json.loads(_reg_path(paths, mountpoint).read_text())
    except (OSError, ValueError, TypeError):
        return False


def _registered_layers(paths: NodePaths, mountpoint: Path) -> list[str] | None:
    """The shared EROFS layers a composed root's registry record names; None
    when there is no readable record (then nothing is known: sweep)."""
    try:
        layers = json.loads(_reg_path(paths, mountpoint).read_text()).get("erofs_layers")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(d) for d in layers] if isinstance(layers, list) else None


def _release(paths: NodePaths, layers: list[str] | None, mountpoint: Path) -> None:
    if layers is None:
        erofsmounts.release_unused(paths)
    elif layers:
        erofsmounts.release(paths, layers, mountpoint)


def registered(paths: NodePaths) -> list[dict[str, object]]:
    out = []
    for f in sorted(paths.mounts.glob("*.json")) if paths.mounts.is_dir() else []:
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def live(paths: NodePaths) -> list[str]:
    """The composed roots that still use the daemon at paths: registered and
    mounted here, or held by a live process (a sandbox's)."""
    overlays = {m.mount_point for m in sysmount.mounts() if m.fstype == "overlay"}
    out = []
    for record in registered(paths):
        try:
            mountpoint = str(record["mountpoint"])
        except (KeyError, TypeError):
            continue
        if mountpoint in overlays or erofsmounts.holder_alive(record.get("holder")):
            out.append(mountpoint)
    return out


def release_node(paths: NodePaths, *, lazy: bool = False,
                 hint: str = "unmount them first, or --lazy") -> list[str]:
    """Make the daemon at paths free to stop: unmount the shared EROFS layer
    mounts (they hold its blobs open). Without lazy, DaemonError naming the
    composed roots that still use it, and nothing changed; with lazy, those
    roots are detached first (a sandbox holding one keeps its own copy, which
    gets EIO on data not read yet) and their records go. Returns the roots
    detached."""
    with erofsmounts.locked(paths):
        using = live(paths)
        if using and not lazy:
            more = f" and {len(using) - 5} more" if len(using) > 5 else ""
            raise DaemonError(f"composed mounts still use the daemon at {paths.mnt}: "
                              f"{', '.join(using[:5])}{more} ({hint})")
        for mountpoint in using:
            if sysmount.is_mount_point(mountpoint):
                try:
                    sysmount.umount(mountpoint, lazy=True)
                except OSError as e:
                    raise DaemonError(f"cannot detach {mountpoint}: {e.strerror}") from e
            _reg_path(paths, Path(mountpoint)).unlink(missing_ok=True)
        erofsmounts.release_unused(paths, everything=lazy)
    return using


def stop_daemon(paths: NodePaths, lazy: bool = False) -> None:
    """Stop the daemon at paths: release the shared layer mounts
    (release_node), SIGTERM it and wait for it to unmount and exit
    (lazyfs.node.end_daemon). Without lazy, DaemonError naming the composed
    mounts that still use it; with lazy, those are detached first."""
    release_node(paths, lazy=lazy)  # (the daemon checks again when signalled)
    end_daemon(paths)


def node_of(mountpoint: Path, default: NodePaths) -> NodePaths:
    """The node a mountpoint belongs to, from the mount itself: a daemon's
    FUSE mount (ROOT/mnt), or a composed root one of the mounted daemons (or
    default's) has in its registry; default when neither says."""
    target = os.path.realpath(mountpoint)
    found = sysmount.find_mount(target)
    if found is not None and found.fstype == "fuse.lazyfs" and os.path.basename(target) == "mnt":
        return NodePaths(Path(target).parent)
    roots = [default] + [NodePaths(Path(m.mount_point).parent) for m in sysmount.mounts()
                         if m.fstype == "fuse.lazyfs" and os.path.basename(m.mount_point) == "mnt"]
    for paths in roots:
        if _reg_path(paths, Path(target)).exists():
            return paths
    return default


def image_of(catalog: ImageCatalog, name: str) -> tuple[str, Image]:
    return catalog.resolve(name)
