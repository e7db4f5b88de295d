"""Shared kernel EROFS mounts of layers: the overlayfs lowers of composed
roots on the kernel path (`mounts.mount_image(..., kernel=True)`).

    ROOT/erofs/<digest>.meta.erofs   the layer's metadata image (pmem.erofs),
                                     on first use fetched from the copy stored
                                     with the layer (fetch_image) or else built,
                                     and kept: deterministic, written atomically
    ROOT/erofs-mnt/<digest>/         the layer's one EROFS mount on this node:
                                     mount(2) source = the meta image, data
                                     "device=ROOT/mnt/blobs/<digest>.data"
                                     (the daemon's blob), ro,nosuid,nodev
    ROOT/erofs-mnt/<digest>.json     the FUSE mount (device number) whose blob
                                     it reads, to tell a stale mount
    ROOT/erofs-refs/<digest>/<key>   one symlink per composed root using the
                                     layer's mount (key = its registry key,
                                     target = its mount point): the layer's
                                     users, an index of the registry below
    ROOT/erofs-refs/.complete        the index was rebuilt from the registry
    ROOT/erofs.lock                  flock: acquiring, releasing and the
                                     registry change that goes with them

The truth is the registry: a layer's EROFS mount is in use while a composed
mount registered in ROOT/mounts/*.json with the layer in its "erofs_layers"
is still mounted. The registry survives crashes of whoever mounted, so the
count does too: `release_unused`, run when the daemon starts or stops (and
whenever the index is missing), takes down exactly the mounts no live
composed root needs, and rebuilds the index from the registry.

Per mount and unmount only the index is touched, never the whole registry or
mount table (they grow with every sandbox on the node): `add_user` links the
new root under each of its layers before the overlay is mounted, and
`release` (after an unmount) drops its links and takes a layer down when none
of its remaining users is still a mounted overlay; a user found unmounted on
the way (a crashed mounter's) is dropped, so the check stops at the first
live user and costs O(1) in the usual case.

overlayfs works on private clones of its lower mounts, so unmounting a
shared EROFS mount never fails under a composed root that still uses it.
Sharing is what the count keeps: every composed root of a layer is made on
the same EROFS superblock, so the node has one page-cache copy of the layer
and Python sees each cold block once.

An EROFS mount made over a daemon that has died reads a dead FUSE file: the
next acquire sees that its recorded FUSE device is not the live one, detaches
it and mounts the layer again; composed roots made before get EIO on data
they had not read until they are unmounted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from composer.catalog import ImageCatalog
from composer.errors import ComposerError
from composer.manifest import LayerManifest
from pmem.erofs import IMAGE_FORMAT, cached_image, meta_name, write_meta

from . import sysmount
from .blob import blob_name
from .errors import MountError
from .nativeblobs import FSTYPE
from .node import NodePaths
from .options import READ_AHEAD_KB

log = logging.getLogger(__name__)

MOUNT_FLAGS = sysmount.MS_RDONLY | sysmount.MS_NOSUID | sysmount.MS_NODEV
_available: bool | None = None


def available() -> bool:
    """Whether this kernel mounts EROFS (loading the module if it must)."""
    global _available
    if _available is None:
        _available = _has_erofs()
        if not _available:
            subprocess.run(["modprobe", "-q", "erofs"], check=False, capture_output=True)
            _available = _has_erofs()
    return _available


def _has_erofs() -> bool:
    try:
        with open("/proc/filesystems") as f:
            return any(line.split()[-1:] == ["erofs"] for line in f)
    except OSError:
        return False


def image_path(paths: NodePaths, digest: str) -> Path:
    return paths.erofs_images / meta_name(digest)


def mount_path(paths: NodePaths, digest: str) -> Path:
    return paths.erofs_mounts / digest


def _state_path(paths: NodePaths, digest: str) -> Path:
    return paths.erofs_mounts / f"{digest}.json"


@contextlib.contextmanager
def locked(paths: NodePaths) -> Iterator[None]:
    """Hold the node's lock on shared-mount bookkeeping (exclusive flock;
    released when the process dies, so a crash never leaves it taken)."""
    if not paths.root.is_dir():  # no node here: nothing is shared yet
        yield
        return
    fd = os.open(paths.erofs_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def build_images(paths: NodePaths, layers: dict[str, LayerManifest]) -> dict[str, Path]:
    """The metadata image of each layer (digest -> manifest), built where
    missing. Needs no lock: images are deterministic and written atomically.
    Raises pmem.errors.PmemError for a layer EROFS cannot hold."""
    paths.erofs_images.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {d: cached_image(m, paths.erofs_images, layer=d) for d, m in layers.items()}


def fetch_image(paths: NodePaths, catalog: ImageCatalog, digest: str) -> bool:
    """Write the layer's metadata image from the one stored with it (made
    when the layer was converted), if the catalog has one this lazyfs reads
    and it is the image the layer's record names; whether it did. A stored
    image that does not match is refused (logged: the caller builds the
    image from the manifest instead), never written."""
    try:
        meta = catalog.load_erofs_meta(digest, IMAGE_FORMAT)
    except ComposerError as e:
        log.warning("%s; building it from the manifest", e)
        return False
    if meta is None:
        return False
    paths.erofs_images.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_meta(meta, image_path(paths, digest))
    return True


# daemon mount point -> the device number of the FUSE mount found there and
# checked in the mount table to be lazyfs (once per daemon, not per mount)
_checked_fuse: dict[str, int] = {}


def _fuse_device(paths: NodePaths) -> str:
    mnt = str(paths.mnt)
    if not sysmount.is_mount_point(mnt) or sysmount.is_stale(mnt):
        raise MountError(f"no live lazyfs daemon serving {paths.mnt}")
    try:
        dev = os.stat(mnt).st_dev
    except OSError as e:
        raise MountError(f"no live lazyfs daemon serving {paths.mnt}: {e.strerror}") from e
    if _checked_fuse.get(mnt) != dev:
        info = sysmount.find_mount(mnt)
        if info is None or info.fstype != "fuse.lazyfs" or os.makedev(*info.dev) != dev:
            raise MountError(f"no live lazyfs daemon serving {paths.mnt}")
        _checked_fuse[mnt] = dev
    return f"{os.major(dev)}:{os.minor(dev)}"


_checked_native: dict[str, int] = {}


def _native_device(paths: NodePaths) -> str | None:
    """The native blob server's mount (lazyfs.nativeblobs) when one serves
    this node: "native MAJ:MIN" (recorded like the daemon's device, so a
    layer mounted over a server that has died since is remounted)."""
    mnt = str(paths.native_blobs)
    try:
        dev = os.stat(mnt).st_dev
        if dev == os.stat(paths.root).st_dev:
            return None  # (nothing mounted there)
    except OSError:
        return None  # missing, or a dead server's mount (ENOTCONN)
    if _checked_native.get(mnt) != dev:
        info = sysmount.find_mount(mnt)
        if info is None or info.fstype != FSTYPE or os.makedev(*info.dev) != dev \
                or sysmount.is_stale(mnt):
            return None
        _checked_native[mnt] = dev
    return f"native {os.major(dev)}:{os.minor(dev)}"


def _recorded_device(paths: NodePaths, digest: str) -> str | None:
    try:
        value = json.loads(_state_path(paths, digest).read_text()).get("fuse_device")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _write_state(paths: NodePaths, digest: str, state: dict[str, str]) -> None:
    path = _state_path(paths, digest)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def acquire(paths: NodePaths, digests: list[str]) -> list[Path]:
    """The shared EROFS mount of each layer, mounted where missing or stale.
    Call under `locked(paths)`, after `build_images`; on failure, mounts
    already made stay until `release_unused` (which the caller runs)."""
    device = _fuse_device(paths)
    native = _native_device(paths)
    blobs = paths.blobs if native is None else paths.native_blobs
    device = native or device
    paths.erofs_mounts.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = []
    for digest in digests:
        target = mount_path(paths, digest)
        if sysmount.is_mount_point(target):
            if (sysmount.fs_magic(target) == sysmount.EROFS_MAGIC
                    and _recorded_device(paths, digest) == device):
                out.append(target)
                continue
            log.warning("%s: EROFS mount of a daemon that is gone (FUSE %s, live %s); "
                        "mounting the layer again", target, _recorded_device(paths, digest),
                        device)
            _take_down(target, lazy=True)
        meta = image_path(paths, digest)
        blob = blobs / blob_name(digest)
        if "," in str(blob):
            raise MountError(f"the daemon's blob path {blob} holds a ',', which EROFS mount "
                             "options cannot carry; use another node root")
        target.mkdir(exist_ok=True)
        bdis = _erofs_bdis()
        try:
            sysmount.mount(str(meta), target, "erofs", MOUNT_FLAGS, f"device={blob}")
        except OSError as e:
            raise MountError(f"kernel EROFS mount of layer {digest} ({meta}, data {blob}) on "
                             f"{target} failed: {e.strerror} (see dmesg)") from e
        _tune_readahead(bdis, digest)
        _write_state(paths, digest, {"fuse_device": device, "meta": str(meta),
                                     "blob": str(blob)})
        out.append(target)
    return out


_BDI = Path("/sys/class/bdi")
_BDI_PREFIX = "erofs-"


def _erofs_bdis() -> set[str]:
    try:
        return {n for n in os.listdir(_BDI) if n.startswith(_BDI_PREFIX)}
    except OSError:
        return set()


def _tune_readahead(before: set[str], digest: str) -> None:
    """Raise the readahead of the EROFS mount just made to READ_AHEAD_KB.

    A file-backed EROFS superblock gets its own bdi, `erofs-<n>` with n from
    a global counter (super_setup_bdi), 128 KiB readahead: EROFS then reads
    the daemon's blob 128 KiB per request, and a cold read-all of the dev
    image took 4.5 s instead of 3.7 s. The bdi is not named after the mount,
    so it is the newest one that appeared across our mount(2) (mounts of this
    node are serialized by `locked`; a concurrent EROFS mount by someone else
    could take the tuning, which costs only speed)."""
    new = [n for n in _erofs_bdis() - before if n[len(_BDI_PREFIX):].isdigit()]
    if not new:
        log.warning("layer %s: no new EROFS bdi after mounting; readahead stays", digest)
        return
    bdi = max(new, key=lambda n: int(n[len(_BDI_PREFIX):]))
    try:
        (_BDI / bdi / "read_ahead_kb").write_text(str(READ_AHEAD_KB))
    except OSError as e:
        log.warning("layer %s: cannot set read_ahead_kb of %s: %s", digest, bdi, e)


def in_use(paths: NodePaths) -> set[str]:
    """Layers whose EROFS mount a composed root still mounted needs, from the
    composed-mount registry and the live mount table (all of both: for
    sweeps; a single unmount asks `release`)."""
    return set(_users(paths))


def _users(paths: NodePaths) -> dict[str, set[str]]:
    """Layer digest -> the composed roots in use (mounted, or held by a live
    process: then as its holder_target) whose registry record names it among
    their EROFS lowers."""
    overlays = {m.mount_point for m in sysmount.mounts() if m.fstype == "overlay"}
    users: dict[str, set[str]] = {}
    for f in paths.mounts.glob("*.json") if paths.mounts.is_dir() else []:
        try:
            reg = json.loads(f.read_text())
            layers = reg.get("erofs_layers") or []
            mountpoint = str(reg["mountpoint"])
        except (OSError, ValueError, KeyError, AttributeError):
            continue
        holder = reg.get("holder")
        if mountpoint in overlays:
            target = mountpoint
        elif holder_alive(holder):
            assert isinstance(holder, dict)
            target = holder_target(Path(mountpoint), int(holder["pid"]), int(holder["start"]))
        else:
            continue
        if isinstance(layers, list):
            for d in layers:
                users.setdefault(str(d), set()).add(target)
    return users


def user_key(mountpoint: str | Path) -> str:
    """A composed root's name in the registry and in the layers' user index."""
    return hashlib.sha256(str(mountpoint).encode()).hexdigest()[:24]


def _index_ready(paths: NodePaths) -> bool:
    return (paths.erofs_refs / ".complete").exists()


def add_user(paths: NodePaths, digests: list[str], mountpoint: Path,
             target: str | None = None) -> None:
    """Record mountpoint as a user of each layer's shared mount (before the
    overlay is made on them), alive while `target` says so (default: while
    mountpoint is a mounted overlay; see set_holder). Call under
    `locked(paths)`."""
    key = user_key(mountpoint)
    for digest in dict.fromkeys(digests):
        d = paths.erofs_refs / digest
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        link = d / key
        link.unlink(missing_ok=True)
        os.symlink(target or str(mountpoint), link)


HELD = "held:"  # a user link's target for a root held by a process (holder_target)


def process_start(pid: int) -> int | None:
    """The start time of process pid (clock ticks since boot), None if gone:
    with the pid, it names one process even after pids wrap."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def holder_alive(holder: object) -> bool:
    """Whether the process a registry record's "holder" ({pid, start}) names
    still runs (then the root it holds is in use)."""
    if not isinstance(holder, dict):
        return False
    try:
        pid, start = int(holder["pid"]), int(holder["start"])
    except (KeyError, TypeError, ValueError):
        return False
    return process_start(pid) == start


def holder_target(mountpoint: Path, pid: int, start: int) -> str:
    return f"{HELD}{pid}:{start}:{mountpoint}"


def _mountpoint_of(target: str) -> str:
    return target[len(HELD):].split(":", 2)[2] if target.startswith(HELD) else target


def _link_alive(target: str) -> bool:
    if target.startswith(HELD):
        pid, start, _ = target[len(HELD):].split(":", 2)
        return holder_alive({"pid": pid, "start": start})
    return sysmount.mounted_as(target, sysmount.OVERLAYFS_MAGIC)


def set_holder(paths: NodePaths, digests: list[str], mountpoint: Path, pid: int,
               start: int) -> None:
    """Record that mountpoint's root is held by process pid (its mount
    namespace keeps the overlay after the host's mount is detached): the
    layers stay in use while it lives (nothing to record before the user
    index is built: building it reads the holders from the registry). Call
    under `locked(paths)`."""
    if digests and _index_ready(paths):
        add_user(paths, digests, mountpoint, holder_target(mountpoint, pid, start))


def _has_live_user(d: Path) -> bool:
    """Whether one of the users linked in d is still a mounted overlay;
    those found gone are unlinked on the way (the first live one ends it)."""
    try:
        it = os.scandir(d)
    except (FileNotFoundError, NotADirectoryError):
        return False
    with it:
        for entry in it:
            try:
                target = os.readlink(entry.path)
            except OSError:
                target = ""
            if target and _link_alive(target):
                return True
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    return False


def release(paths: NodePaths, digests: list[str], mountpoint: Path | None = None
            ) -> list[str]:
    """Drop mountpoint (just unmounted, or never mounted) from the users of
    `digests` and unmount those of their shared mounts no mounted composed
    root uses any more; returns their layers. Looks at these layers' users
    only (the whole registry where the index was never built: release_unused).
    Call under `locked(paths)`."""
    if not _index_ready(paths):
        return release_unused(paths)
    key = None if mountpoint is None else user_key(mountpoint)
    released = []
    for digest in dict.fromkeys(digests):
        d = paths.erofs_refs / digest
        if key is not None:
            (d / key).unlink(missing_ok=True)
        if _has_live_user(d):
            continue
        target = mount_path(paths, digest)
        if sysmount.is_mount_point(target):
            _take_down(target, lazy=False)
            released.append(digest)
        for leftover in (_state_path(paths, digest), target, d):
            with contextlib.suppress(OSError):
                leftover.rmdir() if leftover.is_dir() else leftover.unlink()
    return released


def _rebuild_index(paths: NodePaths, users: dict[str, set[str]]) -> None:
    """Make ROOT/erofs-refs say what the registry says (users), then mark it
    complete. Call under `locked(paths)`."""
    refs = paths.erofs_refs
    refs.mkdir(mode=0o700, parents=True, exist_ok=True)
    for entry in refs.iterdir():
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        want = {user_key(_mountpoint_of(m)) for m in users.get(entry.name, ())}
        for link in entry.iterdir():
            if link.name not in want:
                with contextlib.suppress(OSError):
                    link.unlink()
        if entry.name not in users:
            with contextlib.suppress(OSError):
                entry.rmdir()
    for digest, mountpoints in users.items():
        d = refs / digest
        d.mkdir(mode=0o700, exist_ok=True)
        for m in mountpoints:
            link = d / user_key(_mountpoint_of(m))
            if not link.is_symlink():
                os.symlink(m, link)
    (refs / ".complete").touch()


def shared_mounts(paths: NodePaths) -> dict[str, sysmount.MountInfo]:
    """The node's EROFS layer mounts now in the mount table, by layer digest."""
    where = os.path.realpath(paths.erofs_mounts)
    return {os.path.basename(m.mount_point): m for m in sysmount.mounts()
            if m.fstype == "erofs" and os.path.dirname(m.mount_point) == where}


def release_unused(paths: NodePaths, *, everything: bool = False) -> list[str]:
    """Unmount the shared EROFS mounts no mounted composed root uses (all of
    them with everything=True, lazily where busy); returns their layers.
    Reads the whole registry and mount table, and rebuilds the user index
    from them: for sweeps (daemon start and stop), not per unmount (`release`).
    Call under `locked(paths)`."""
    if not paths.erofs_mounts.is_dir():
        return []
    users = _users(paths)
    _rebuild_index(paths, users)
    keep = set() if everything else set(users)
    released = []
    for digest, info in shared_mounts(paths).items():
        if digest in keep:
            continue
        _take_down(Path(info.mount_point), lazy=everything)
        released.append(digest)
    mounted = set(shared_mounts(paths))
    for entry in paths.erofs_mounts.iterdir():  # leftovers of mounts gone
        name = entry.name.removesuffix(".json")
        if name in mounted or name.startswith("."):
            continue
        with contextlib.suppress(OSError):
            entry.unlink() if entry.name.endswith(".json") else entry.rmdir()
    return released


def _take_down(target: Path, *, lazy: bool) -> None:
    while sysmount.is_mount_point(target):
        try:
            sysmount.umount(target, lazy=lazy)
        except OSError as e:
            if lazy:
                raise MountError(f"cannot detach the EROFS layer mount {target}: "
                                 f"{e.strerror}") from e
            log.warning("%s busy (%s); detaching it lazily", target, e.strerror)
            lazy = True
