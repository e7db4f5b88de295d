"""A microVM's writable upper, as the guest agent streams it (the UPPER
call, runtime/native/guest-agent.c), written into a fresh host directory in
the form of an overlayfs upper, for composer.snapshot.pack_diff to pack as
it packs a container's or a full VM's.

Every byte of the stream comes from the guest and is hostile input. The
stream is a sequence of ENTRY frames (parents before their children), each
regular file's bytes following its entry as FDATA frames, then OK:

    ENTRY  kind u32, mode u32 (07777), uid u32, gid u32, mtime_ns i64,
           size u64 (files; 0 otherwise), flags u32 (1: an opaque directory),
           path (u32 length + bytes, relative), target (u32 length + bytes:
           a symlink's target, or the earlier file a hard link names)

What is refused, before anything of the entry touches the host (the call
then fails, the directory is removed): a path that is empty, absolute,
longer than MAX_PATH bytes or with a component empty, `.`, `..`, longer
than MAX_NAME or holding a NUL; a path seen before; a parent that is not a
directory of the stream (so no path goes through a symlink or a file); more
than `max_entries` entries or MAX_PATH_BYTES of path names; regular files
whose sizes add up past `max_bytes` (the upper's own size: a sparse file the
host would read as zeros); file data other than the size its entry said;
an unknown kind, mode bits outside 07777, a flag outside a directory, a
target where none belongs. Everything is made relative to directory
descriptors opened with O_NOFOLLOW from the fresh root, with O_EXCL (mknod,
mkfifo, symlink and link refuse an existing name too), so nothing the host
writes follows a link. Device nodes are never made: the only character
device is overlayfs' whiteout (0:0), which pack_diff turns into the
layer's whiteout; an opaque directory gets overlayfs' marker
(trusted.overlay.opaque=y), which pack_diff reads. Owners and modes are the
guest's (setuid bits kept: they grant the verifier's guest root, inside its
VM, as a full VM's disk does); the directory is 0700 under the sandbox's own
directory, so no host user reaches what is in it.
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path
from types import TracebackType

from ..errors import SandboxError
from ..files import remove_tree

MAX_PATH = 4096       # a path's bytes (PATH_MAX)
MAX_NAME = 255        # a component's (NAME_MAX)
MAX_TARGET = 4095     # a symlink's target
MAX_PATH_BYTES = 64 << 20  # all paths and targets of one stream: the host's memory for them
ENTRY_HEAD = struct.Struct("<IIIIqQII")  # kind mode uid gid mtime_ns size flags path-length
FILE, DIR, SYMLINK, WHITEOUT, FIFO, LINK = range(1, 7)
KINDS = {FILE: "file", DIR: "directory", SYMLINK: "symlink", WHITEOUT: "whiteout",
         FIFO: "fifo", LINK: "hard link"}
OPAQUE = 1
OPAQUE_XATTR = "trusted.overlay.opaque"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ZERO = bytes(1 << 16)


class UpperRefused(SandboxError):
    """The guest's upper stream broke a rule (the message says which, on one
    line): nothing of it is kept."""


def shown(raw: bytes | str, limit: int = 120) -> str:
    """A guest-chosen name or message as one printable line."""
    text = raw.decode(errors="backslashreplace") if isinstance(raw, bytes) else raw
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return out if len(out) <= limit else out[:limit] + "..."


class UpperTree:
    """A fresh host directory the stream is written into (`dest`, made here,
    0700; removed again unless the stream finished)."""

    def __init__(self, dest: Path, *, max_bytes: int, max_entries: int) -> None:
        self.dest = dest
        self.bytes_left = max_bytes
        self.max_bytes = max_bytes
        self.entries_left = max_entries
        self.max_entries = max_entries
        self.names_left = MAX_PATH_BYTES
        self.dirs: dict[bytes, int] = {b"": 0}    # directory -> mtime to set at the end
        self.files: set[bytes] = set()            # regular files (hard link targets)
        self.seen: set[bytes] = {b""}
        self.entries = 0
        self.bytes = 0
        # the file being received: fd, bytes still due, path, mode, uid, gid, mtime_ns
        self._pending: tuple[int, int, bytes, int, int, int, int] | None = None
        self._parent: tuple[bytes, int] | None = None  # the last parent's fd
        os.mkdir(dest, 0o700)
        self.root = os.open(dest, _DIR_FLAGS)
        self.done = False

    def __enter__(self) -> UpperTree:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
        if not self.done:
            remove_tree(self.dest)

    def close(self) -> None:
        if self._pending is not None:
            os.close(self._pending[0])
            self._pending = None
        if self._parent is not None:
            os.close(self._parent[1])
            self._parent = None
        if self.root >= 0:
            os.close(self.root)
            self.root = -1

    # -- the stream ----------------------------------------------------------
    @property
    def expecting(self) -> int:
        """Bytes of file data still due for the last file entry."""
        return 0 if self._pending is None else self._pending[1]

    def entry(self, payload: bytes) -> None:
        if self._pending is not None:
            raise UpperRefused(f"an entry before the {self._pending[1]} bytes still due of "
                               f"{shown(self._pending[2])!r}")
        if len(payload) < ENTRY_HEAD.size + 4:
            raise UpperRefused(f"an entry of {len(payload)} bytes (too short)")
        kind, mode, uid, gid, mtime, size, flags, plen = ENTRY_HEAD.unpack_from(payload)
        at = ENTRY_HEAD.size
        if plen > MAX_PATH or at + plen + 4 > len(payload):
            raise UpperRefused(f"an entry whose path takes {plen} bytes")
        path = payload[at:at + plen]
        (tlen,) = struct.unpack_from("<I", payload, at + plen)
        at += plen + 4
        if at + tlen != len(payload):
            raise UpperRefused(f"{shown(path)!r}: an entry of {len(payload)} bytes whose "
                               f"target takes {tlen}")
        target = payload[at:]
        self._check(kind, mode, uid, gid, size, flags, path, target)
        parent, _, name = path.rpartition(b"/")
        pfd = self._dir_fd(parent)
        self.entries += 1
        self.seen.add(path)
        try:
            self._make(kind, mode, uid, gid, mtime, size, flags, path, name, target, pfd)
        except OSError as e:
            raise UpperRefused(f"{shown(path)!r}: {e.strerror}") from e

    def _check(self, kind: int, mode: int, uid: int, gid: int, size: int, flags: int,
               path: bytes, target: bytes) -> None:
        what = repr(shown(path))
        if self.entries_left <= 0:
            raise UpperRefused(f"more than {self.max_entries} entries")
        self.entries_left -= 1
        self.names_left -= len(path) + len(target)
        if self.names_left < 0:
            raise UpperRefused(f"more than {MAX_PATH_BYTES} bytes of path names")
        if kind not in KINDS:
            raise UpperRefused(f"{what}: an entry of unknown kind {kind}")
        if not path or path.startswith(b"/") or len(path) > MAX_PATH:
            raise UpperRefused(f"{what}: not a relative path below the upper")
        for part in path.split(b"/"):
            if part in (b"", b".", b"..") or b"\0" in part or len(part) > MAX_NAME:
                raise UpperRefused(f"{what}: a path with an empty, '.', '..', NUL or "
                                   "over-long component")
        if path in self.seen:
            raise UpperRefused(f"{what}: sent twice")
        parent = path.rpartition(b"/")[0]
        if parent not in self.dirs:
            raise UpperRefused(f"{what}: its parent is not a directory sent before it "
                               "(a path through a link or a file?)")
        if mode & ~0o7777 or uid >= 0xFFFFFFFF or gid >= 0xFFFFFFFF:
            raise UpperRefused(f"{what}: mode {mode:o} or owner {uid}:{gid} out of range")
        if flags & ~OPAQUE or (flags and kind != DIR):
            raise UpperRefused(f"{what}: flags {flags:#x} on a {KINDS[kind]}")
        if size and kind != FILE:
            raise UpperRefused(f"{what}: a {KINDS[kind]} with a size")
        if kind == FILE:
            if size > self.bytes_left:
                raise UpperRefused(f"{what} ({size} bytes) takes the upper's files past "
                                   f"{self.max_bytes} bytes, more than it holds (a sparse "
                                   "file?)")
            self.bytes_left -= size
        if kind == SYMLINK:
            if not 0 < len(target) <= MAX_TARGET or b"\0" in target:
                raise UpperRefused(f"{what}: a symlink target of {len(target)} bytes or "
                                   "with a NUL")
        elif kind == LINK:
            if target not in self.files:
                raise UpperRefused(f"{what}: a hard link to {shown(target)!r}, not a file "
                                   "sent before it")
        elif target:
            raise UpperRefused(f"{what}: a {KINDS[kind]} with a target")

    def _open_dir(self, parent: bytes) -> int:
        """A new descriptor of the directory `parent` (one of ours), opened
        component by component from the root without following links."""
        fd = os.dup(self.root)
        try:
            for part in parent.split(b"/") if parent else ():
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _dir_fd(self, parent: bytes) -> int:
        """`parent`'s descriptor, kept for the next entry (the agent sends a
        directory's entries together)."""
        if self._parent is not None and self._parent[0] == parent:
            return self._parent[1]
        fd = self._open_dir(parent)
        if self._parent is not None:
            os.close(self._parent[1])
        self._parent = (parent, fd)
        return fd

    def _make(self, kind: int, mode: int, uid: int, gid: int, mtime: int, size: int,
              flags: int, path: bytes, name: bytes, target: bytes, pfd: int) -> None:
        if kind == DIR:
            os.mkdir(name, 0o700, dir_fd=pfd)
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
            try:
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
                if flags & OPAQUE:
                    os.setxattr(fd, OPAQUE_XATTR, b"y")
            finally:
                os.close(fd)
            self.dirs[path] = mtime
            return
        if kind == FILE:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600, dir_fd=pfd)
            self.files.add(path)
            self._pending = (fd, size, path, mode, uid, gid, mtime)
            if size == 0:
                self._finish_file()
            return
        if kind == LINK:
            tparent, _, tname = target.rpartition(b"/")
            tfd = self._open_dir(tparent)
            try:
                os.link(tname, name, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
            finally:
                os.close(tfd)
            return
        if kind == SYMLINK:
            os.symlink(target, name, dir_fd=pfd)
        elif kind == WHITEOUT:
            os.mknod(name, stat.S_IFCHR, 0, dir_fd=pfd)
        else:
            os.mkfifo(name, 0o600, dir_fd=pfd)
        os.chown(name, uid, gid, dir_fd=pfd, follow_symlinks=False)
        if kind == FIFO:
            os.chmod(name, mode, dir_fd=pfd)  # just made by mkfifo: not a link
        os.utime(name, ns=(mtime, mtime), dir_fd=pfd, follow_symlinks=False)

    def data(self, chunk: bytes) -> None:
        if self._pending is None:
            raise UpperRefused("file data outside a file")
        fd, due, path, mode, uid, gid, mtime = self._pending
        if len(chunk) > due:
            raise UpperRefused(f"{shown(path)!r}: more data than its size")
        try:
            if chunk == _ZERO[:len(chunk)]:  # a hole stays a hole
                os.lseek(fd, len(chunk), os.SEEK_CUR)
            else:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except OSError as e:
            raise UpperRefused(f"{shown(path)!r}: {e.strerror}") from e
        self.bytes += len(chunk)
        self._pending = (fd, due - len(chunk), path, mode, uid, gid, mtime)
        if due == len(chunk):
            self._finish_file()

    def _finish_file(self) -> None:
        assert self._pending is not None
        fd, _, path, mode, uid, gid, mtime = self._pending
        self._pending = None
        try:
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)  # after the chown, which clears setuid
            os.utime(fd, ns=(mtime, mtime))
        except OSError as e:
            raise UpperRefused(f"{shown(path)!r}: {e.strerror}") from e
        finally:
            os.close(fd)

    def finish(self) -> None:
        """The stream's OK: directories get their times (children first), and
        the tree is kept."""
        if self._pending is not None:
            raise UpperRefused(f"the stream ended {self._pending[1]} bytes short of "
                               f"{shown(self._pending[2])!r}")
        for path in sorted((p for p in self.dirs if p), key=lambda p: -p.count(b"/")):
            parent, _, name = path.rpartition(b"/")
            mtime = self.dirs[path]
            try:
                os.utime(name, ns=(mtime, mtime), dir_fd=self._dir_fd(parent),
                         follow_symlinks=False)
            except OSError as e:
                raise UpperRefused(f"{shown(path)!r}: {e.strerror}") from e
        self.close()
        self.done = True
