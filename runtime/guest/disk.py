"""An image as a whole disk, for full VMs: an ext4 file system built from the
composed image, cached per image, and a copy-on-write overlay per sandbox.

    base = base_disk(images, image, cache)   # BaseDisk(path, init, size); built once
    make_overlay(base.path, vmdir / "disk.qcow2")

`image` is a ResolvedImage (the digest the node resolved once, at create):
the disk is found and built by digest, never by name. The base is a raw
ext4 image made with `mkfs.ext4 -d` from the image mounted
read-only through the node's lazyfs daemon (lazyfs.mounts.mount_image), so
it works from a local store or a cluster alike. Building it reads every file
of the image once per node: the disk is not lazy (a VM's kernel wants a
block device; serving one lazily would need a block-level lazy loader, such
as a qcow2 backing file on the FUSE blob, which is not built). The file is
sparse on the host: its free space (HEADROOM_MB, the room a sandbox has for
its writes) costs nothing until written.

CACHE/<image digest>-<code fingerprint>-<headroom>.ext4   the base, mode 0444
CACHE/<same>.json                                         {"init": "/sbin/init" | null}

`init` says whether the image has an init of its own (/sbin/init, /etc/init
or /bin/init resolving, inside the image, to an executable file): the guest
then runs it as PID 1, next to the agent; otherwise the agent is PID 1.

Each sandbox writes to its own qcow2 overlay (`qemu-img create -f qcow2 -b
BASE -F raw`), never to the base: QEMU opens the backing file read-only, so
no VM can change what another one reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chunkstore.digests import digest_key
from lazyfs.mounts import MountError, mount_image, unmount

from ..errors import BackendUnavailable
from ..images import Images
from ..spec import ResolvedImage
from .cachelock import locked, mark_used

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path(os.environ.get("LAZYFS_VM_DISK_CACHE", "/var/cache/lazyfs/vm-disks"))
HEADROOM_MB = int(os.environ.get("LAZYFS_VM_DISK_HEADROOM_MB", "1024"))
INITS = ("/sbin/init", "/etc/init", "/bin/init")  # as the kernel tries them
TOOL_TIMEOUT = 600.0
BLOCK = 4096
MAX_LINKS = 40


@dataclass(frozen=True)
class BaseDisk:
    path: Path
    init: str | None  # the image's own init, if it has one
    size: int


def tools_missing() -> str | None:
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 (apt-get install e2fsprogs)"
    if shutil.which("qemu-img") is None:
        return "qemu-img (apt-get install qemu-utils)"
    return None


def fingerprint() -> str:
    """Changes when this code does: a disk built another way is rebuilt."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def _run(cmd: list[str], what: str) -> None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT,
                           check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        raise BackendUnavailable(f"{what}: {cmd[0]} is missing") from e
    except subprocess.TimeoutExpired as e:
        raise BackendUnavailable(f"{what}: {cmd[0]} took longer than {TOOL_TIMEOUT:g}s") from e
    if p.returncode != 0:
        raise BackendUnavailable(f"{what}: {cmd[0]} failed: "
                                 f"{(p.stderr or p.stdout).strip()[-400:]}")


def resolve_in(root: Path, path: str) -> Path | None:
    """`path` resolved as the image would see it with `root` as "/" (absolute
    and ".." links stay inside); None when it does not exist."""
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
        p = root.joinpath(*cur, part)
        try:
            st = os.lstat(p)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                return None
            target = os.readlink(p)
            if target.startswith("/"):
                cur = []
            parts = [x for x in target.split("/") if x] + parts
            continue
        cur.append(part)
    return root.joinpath(*cur)


def find_init(root: Path) -> str | None:
    for candidate in INITS:
        p = resolve_in(root, candidate)
        if p is None:
            continue
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
            return candidate
    return None


def _tree_size(root: Path) -> tuple[int, int]:
    """(bytes the tree needs in 4 KiB blocks, entries)."""
    total = entries = 0
    stack = [root]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for e in it:
                entries += 1
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    total += BLOCK
                    stack.append(Path(e.path))
                elif stat.S_ISREG(st.st_mode):
                    total += -(-st.st_size // BLOCK) * BLOCK
    return total, entries


def base_disk(images: Images, image: ResolvedImage, cache: Path = DEFAULT_CACHE,
              headroom_mb: int = HEADROOM_MB,
              progress: Callable[[str], None] | None = None) -> BaseDisk:
    """The cached base disk of the image (built now if missing, told to
    `progress`; needs the node's lazyfs daemon then). Safe to call
    concurrently (a lock file)."""
    name, digest = image.name, image.digest
    stem = cache / f"{digest_key(digest)}-{fingerprint()}-{headroom_mb}"
    raw, meta = stem.with_name(stem.name + ".ext4"), stem.with_name(stem.name + ".json")
    found = _load(raw, meta)
    if found is not None:
        mark_used(raw)
        mark_used(meta)
        return found
    with locked(cache):
        found = _load(raw, meta)
        if found is not None:
            return found
        if progress is not None:
            progress(f"building the VM disk of {name} (mkfs.ext4 over the lazy mount: "
                     "reads the whole image, once per node)")
        init, size = _build(images, image, raw, headroom_mb)
        tmp = meta.with_name(f".{meta.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"image": digest, "init": init}))
        os.replace(tmp, meta)
        log.info("built the VM disk of %s: %s (%d MiB, init %s)", name, raw, size >> 20, init)
        return BaseDisk(raw, init, size)


def _load(raw: Path, meta: Path) -> BaseDisk | None:
    try:
        info = json.loads(meta.read_text())
        size = raw.stat().st_size
    except (OSError, ValueError):
        return None
    init = info.get("init") if isinstance(info, dict) else None
    return BaseDisk(raw, init if isinstance(init, str) else None, size)


def _build(images: Images, image: ResolvedImage, raw: Path, headroom_mb: int
           ) -> tuple[str | None, int]:
    name = image.name
    paths = images.ensure_daemon()
    mnt = Path(tempfile.mkdtemp(dir=raw.parent, prefix=".mnt-"))
    fd, tmp = tempfile.mkstemp(dir=raw.parent, prefix=f".{raw.name}.")
    try:
        try:
            mount_image(paths, images.catalog(), image.digest, mnt)
        except MountError as e:
            raise BackendUnavailable(f"cannot mount {name} to build its VM disk: {e}") from e
        try:
            used, entries = _tree_size(mnt)
            init = find_init(mnt)
            # ext4's own metadata (inode tables, journal, group descriptors) ~ 10 %
            size = used + used // 8 + ((64 + headroom_mb) << 20)
            size = -(-size // (4 << 20)) * (4 << 20)
            os.ftruncate(fd, size)
            _run(["mkfs.ext4", "-q", "-F", "-t", "ext4", "-L", "lazyfs-root", "-m", "0",
                  "-N", str(entries + max(entries, 65536)),
                  "-E", "lazy_itable_init=1,lazy_journal_init=1", "-d", str(mnt), tmp],
                 f"building the VM disk of {name}")
        finally:
            try:
                unmount(paths, mnt)
            except MountError:
                unmount(paths, mnt, lazy=True)
        os.fchmod(fd, 0o444)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, raw)
        return init, size
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        try:
            mnt.rmdir()
        except OSError as e:
            log.warning("cannot remove the mount point %s: %s", mnt, e)


def make_overlay(base: Path, dest: Path) -> None:
    """A qcow2 file at dest whose unwritten blocks read from base (raw)."""
    _run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base.absolute()), "-F", "raw",
          str(dest)], f"creating the disk overlay {dest}")
