"""mount(2) and umount2(2) through ctypes, and /proc/self/mountinfo.

The `mount` command works too, but a sandbox burst mounts an overlay per
sandbox; a syscall costs microseconds where a process costs milliseconds.
"""

from __future__ import annotations

import ctypes
import errno
import os
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


def mount(source: str, target: str | Path, fstype: str, flags: int = 0,
          data: str = "") -> None:
    if _libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags,
                   data.encode() if data else None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} on {target}: {os.strerror(e)}")


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


def find_mount(path: str | Path) -> MountInfo | None:
    """The topmost mount exactly at `path` (not the one containing it)."""
    p = os.path.abspath(path)
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
