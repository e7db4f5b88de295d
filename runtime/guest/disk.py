"""A full VM's own disk and what the guest needs to know of its image.

    init = image_init(images, image)          # "/sbin/init" or None, from the manifests
    make_upper(vmdir / "upper.ext4", size_mb) # the sandbox's writable upper, empty

A full VM's root is the image's layers as lazy virtio-pmem EROFS lowers
(runtime/guest/pmemimages.py, exactly as a microVM's) under an overlayfs
whose upper is this disk: an empty ext4 file of the sandbox's `disk_mb`,
sparse on the host (a few hundred KiB allocated whatever its size), made
per sandbox by `mkfs.ext4` on a fresh file (20-60 ms for 1-4 GiB here; a
sparse copy of a cached template is no faster and would be one more cache
to sweep and collect) and attached
read-write as virtio-blk. Nothing of the image is read to make it, so the
first VM of an image no longer waits for a copy of the image. No journal:
the upper lives and dies with its sandbox (a VM that crashes is not
restarted), and its pause snapshot is taken with the disk as it is.
Inode tables are not initialised (`lazy_itable_init`), and the guest
mounts it with `noinit_itable`, so neither side writes them out.

`init` says whether the image has an init of its own (/sbin/init, /etc/init
or /bin/init resolving, inside the composed image, to an executable
file): the guest then runs it as PID 1, next to the agent; otherwise the
agent is PID 1. It is decided from the layers' manifests (no mount, no
data read) and remembered per image digest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from composer.compose import compose
from composer.manifest import Entry, Kind
from lazyfs import sysmount

from ..errors import BackendUnavailable, SandboxError
from ..images import Images
from ..spec import ResolvedImage

log = logging.getLogger(__name__)

INITS = ("/sbin/init", "/etc/init", "/bin/init")  # as the kernel tries them
UPPER_LABEL = "lazyfs-upper"
MIN_UPPER_MB = 16  # ext4 with room for overlayfs' work directory and a few files
TOOL_TIMEOUT = 60.0
MAX_LINKS = 40

_inits: dict[str, str | None] = {}  # image digest -> its init (manifests are immutable)
_inits_lock = threading.Lock()


def tools_missing() -> str | None:
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 (apt-get install e2fsprogs)"
    return None


def resolve_in(tree: dict[str, Entry], path: str) -> Entry | None:
    """The entry `path` names in a composed tree as the image would see it
    ("/" its root: absolute and ".." links stay inside); None when it does
    not exist or loops."""
    parts = [p for p in path.split("/") if p]
    cur: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if cur:
                cur.pop()
            continue
        e = tree.get("/".join([*cur, part]))
        if e is None:
            return None
        if e.kind == Kind.SYMLINK:
            links += 1
            if links > MAX_LINKS:
                return None
            if e.target.startswith("/"):
                cur = []
            parts = [x for x in e.target.split("/") if x] + parts
            continue
        cur.append(part)
    return tree.get("/".join(cur))


def find_init(tree: dict[str, Entry]) -> str | None:
    """The first of INITS that is an executable file in the composed tree."""
    for candidate in INITS:
        e = resolve_in(tree, candidate)
        if e is not None and e.kind == Kind.HARDLINK:
            e = tree.get(e.target)
        if e is not None and e.kind in (Kind.FILE, Kind.HARDLINK) and e.mode & 0o111:
            return candidate
    return None


def image_init(images: Images, image: ResolvedImage) -> str | None:
    """The image's own init (see the module docstring), from its manifests."""
    with _inits_lock:
        if image.digest in _inits:
            return _inits[image.digest]
    catalog = images.catalog()
    tree = {e.path: e for e, _ in compose([catalog.load_layer(d) for d in image.layers])}
    init = find_init(tree)
    with _inits_lock:
        _inits[image.digest] = init
    return init


def make_upper(dest: Path, size_mb: int) -> None:
    """An empty ext4 file system of size_mb MiB at dest (sparse)."""
    with open(dest, "xb") as f:
        os.ftruncate(f.fileno(), size_mb << 20)
    cmd = ["mkfs.ext4", "-q", "-F", "-t", "ext4", "-L", UPPER_LABEL, "-m", "0",
           "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard", str(dest)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT,
                           check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        dest.unlink(missing_ok=True)
        raise BackendUnavailable(f"making the VM's writable disk {dest}: {e}") from e
    if p.returncode != 0:
        dest.unlink(missing_ok=True)
        raise BackendUnavailable(f"making the VM's writable disk {dest}: mkfs.ext4 failed: "
                                 f"{(p.stderr or p.stdout).strip()[-400:]}")


@contextlib.contextmanager
def reading(upper: Path, mountpoint: Path) -> Iterator[Path]:
    """The overlay upper on a VM's disk (the VMM stopped: nothing writes the
    file meanwhile) as a read-only host directory, for packing. The guest
    wrote every byte of it, metadata included: it is checked by `e2fsck -fn`
    (userspace, read-only) before the host kernel mounts it, and mounted
    ro, noload, nodev, nosuid, noexec from a read-only loop device; what is
    in it is then read as any sandbox's upper is (composer.snapshot
    .pack_diff: lstat, O_NOFOLLOW, never a path resolved through it)."""
    try:
        p = subprocess.run(["e2fsck", "-f", "-n", str(upper)], capture_output=True, text=True,
                           timeout=TOOL_TIMEOUT, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxError(f"checking the VM's disk {upper.name}: {e}") from e
    if p.returncode != 0:
        lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
        raise SandboxError(f"the VM's disk {upper.name} fails e2fsck -fn (exit {p.returncode}), "
                           f"so it is not mounted on the host: {' / '.join(lines[-3:])[-300:]}")
    mountpoint.mkdir(mode=0o700)
    try:
        try:
            m = subprocess.run(["mount", "-t", "ext4", "-o",
                                "loop,ro,noload,nodev,nosuid,noexec,errors=continue",
                                str(upper), str(mountpoint)], capture_output=True, text=True,
                               timeout=TOOL_TIMEOUT, check=False, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SandboxError(f"mounting the VM's disk {upper.name}: {e}") from e
        if m.returncode != 0:
            said = " ".join((m.stderr or m.stdout).split())
            raise SandboxError(f"mounting the VM's disk {upper.name}: {said[-300:]}")
        try:
            yield mountpoint / "upper"
        finally:
            sysmount.umount(mountpoint, lazy=True)  # the loop device goes with it (autoclear)
    finally:
        with contextlib.suppress(OSError):
            mountpoint.rmdir()


def release(mountpoint: Path) -> None:
    """Undo what a capture killed midway left at `mountpoint` (reading's):
    its mount and the directory."""
    if os.path.ismount(mountpoint):
        sysmount.umount(mountpoint, lazy=True)
    with contextlib.suppress(FileNotFoundError):
        mountpoint.rmdir()
