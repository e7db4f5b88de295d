"""mount(2) and umount2(2) through ctypes, and /proc/self/mountinfo.

The `mount` command works too, but a sandbox burst mounts an overlay per
sandbox; a syscall costs microseconds where a process costs milliseconds.

Whether a path is a mount point is asked of statx(2) (STATX_ATTR_MOUNT_ROOT:
one syscall), not of the mount table: /proc/self/mountinfo grows with every
sandbox on the node (an overlay each, maybe a tmpfs), and parsing it on each
create and kill made both cost O(sandboxes). `mounts()` still reads the whole
table for what needs it (sweeps, listings, a mount's source and options).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MNT_FORCE = 1
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

# statx(2) (glibc >= 2.28) and statfs(2): struct layouts of x86-64/aarch64
AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_NO_AUTOMOUNT = 0x800
AT_STATX_DONT_SYNC = 0x4000  # FUSE: answer from the attribute cache, never ask a daemon
STATX_BASIC_STATS = 0x7FF
STATX_ATTR_MOUNT_ROOT = 0x2000
_STATX_SIZE = 256
_STATFS_SIZE = 120
# filesystem magic numbers (statfs f_type) of the mounts this node makes
OVERLAYFS_MAGIC = 0x794C7630
EROFS_MAGIC = 0xE0F5E1E2
FUSE_MAGIC = 0x65735546
TMPFS_MAGIC = 0x01021994
_statx = getattr(_libc, "statx", None)
if _statx is not None:
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                       ctypes.c_void_p]
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]


def mount(source: str, target: str | Path, fstype: str, flags: int = 0,
          data: str = "") -> None:
    if _libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags,
                   data.encode() if data else None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} on {target}: {os.strerror(e)}")


# open_tree(2) and mount_setattr(2) (x86-64 and aarch64 share the numbers of
# syscalls added after the unified table): an idmapped copy of a mount
_SYS_OPEN_TREE = 428
_SYS_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 1
_AT_EMPTY_PATH = 0x1000
_MOUNT_ATTR_IDMAP = 0x100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def idmapped_tree(path: str | Path, userns_fd: int) -> int:
    """A detached copy of the mount at `path` whose files show their owners
    through the id map of user namespace `userns_fd` (a stored id N shows as
    the id that map gives N); the caller closes the descriptor it gets, and
    names the copy as /proc/self/fd/N (an overlay lower, for one). Needs a
    filesystem that allows idmapped mounts (EROFS, tmpfs, ext4, ... on 6.x)."""
    fd = int(_libc.syscall(_SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path),
                           _OPEN_TREE_CLONE | os.O_CLOEXEC))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"open_tree {path}: {os.strerror(e)}")
    attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
    if _libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                     ctypes.c_size_t(ctypes.sizeof(attr))) != 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise OSError(e, f"idmapping the mount of {path}: {os.strerror(e)}")
    return fd


def umount(target: str | Path, *, lazy: bool = False) -> None:
    if _libc.umount2(os.fsencode(target), MNT_DETACH if lazy else 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


@dataclass(frozen=True)
class MountInfo:
    mount_point: str
    fstype: str
    source: str
    dev: tuple[int, int]
    options: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[MountInfo]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts = left.split()
            fstype, source, *rest = right.split()
            major, minor = parts[2].split(":")
            out.append(MountInfo(_unescape(parts[4]), fstype, _unescape(source),
                                 (int(major), int(minor)), rest[0] if rest else ""))
    return out


def is_mount_point(path: str | Path) -> bool:
    """Whether a mount sits exactly at `path` (one statx; a dead FUSE mount
    counts, as it does in the mount table). Falls back to the mount table
    where statx cannot tell (old kernels, errors other than a missing path)."""
    p = os.path.abspath(path)
    root = _mount_root(p)
    if root is None:
        return any(m.mount_point == p for m in mounts())
    return root


def _mount_root(p: str) -> bool | None:
    """statx's STATX_ATTR_MOUNT_ROOT of p; None when it cannot say."""
    if _statx is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    flags = AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT | AT_STATX_DONT_SYNC
    if _statx(AT_FDCWD, os.fsencode(p), flags, STATX_BASIC_STATS, buf) != 0:
        e = ctypes.get_errno()
        return False if e in (errno.ENOENT, errno.ENOTDIR) else None
    attributes, = struct.unpack_from("=Q", buf, 8)
    mask, = struct.unpack_from("=Q", buf, 56)
    if not mask & STATX_ATTR_MOUNT_ROOT:  # kernel < 5.8
        return None
    return bool(attributes & STATX_ATTR_MOUNT_ROOT)


def fs_magic(path: str | Path) -> int | None:
    """statfs(2) f_type of the filesystem at path (None on error). On a FUSE
    mount this asks its daemon."""
    buf = ctypes.create_string_buffer(_STATFS_SIZE)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    magic: int = struct.unpack_from("=q", buf, 0)[0]
    return magic & 0xFFFFFFFF


def mounted_as(path: str | Path, magic: int) -> bool:
    """A mount of the filesystem type `magic` sits exactly at path: two
    syscalls, no mount table."""
    return is_mount_point(path) and fs_magic(path) == magic


def find_mount(path: str | Path) -> MountInfo | None:
    """The topmost mount exactly at `path` (not the one containing it).
    Reads the mount table only when statx says something is mounted there
    (is_mount_point is the cheap question)."""
    p = os.path.abspath(path)
    if _mount_root(p) is False:
        return None
    found = None
    for m in mounts():
        if m.mount_point == p:
            found = m
    return found


def is_stale(path: str | Path) -> bool:
    """A FUSE mount whose daemon is gone (ENOTCONN on access). stat alone can
    be answered from the kernel's attribute cache (lazyfs caches attributes
    for hours); statfs always asks the daemon."""
    for probe in (os.stat, os.statvfs):
        try:
            probe(path)
        except OSError as e:
            return e.errno == errno.ENOTCONN
    return False
