"""File operations inside a sandbox's root, from the host, that can never
leave it.

Every path is resolved by the kernel with openat2(RESOLVE_IN_ROOT): "..",
absolute symlinks and symlinks pointing outside all stay under the sandbox's
root, as they would for a process chrooted there, so a sandbox cannot plant a
link that makes the host read or write its own files. Writes are atomic
(temporary name + rename in the same directory).
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath

from pydantic import BaseModel

from .errors import FileError

log = logging.getLogger(__name__)

SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
MAX_READ = 256 << 20  # per read(); larger files go through download (streamed later)
MAX_LIST = 100_000
# Mounts the container runtime places over the root: the host's view of the
# root does not show what the sandbox sees there.
RUNTIME_MOUNTS = ("proc", "sys", "dev")

_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


class FileInfo(BaseModel):
    name: str
    path: str
    type: str  # file, dir, symlink, other
    size: int
    mode: int
    mtime: float


def _openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    # NO_XDEV: a link into the sandbox's /proc, /sys or /dev (other mounts
    # than its root) is refused, as those paths themselves are
    how = _OpenHow(flags | os.O_CLOEXEC, mode,
                   RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)
    fd = _libc.syscall(SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return int(fd)


def _clean(path: str) -> PurePosixPath:
    if not path.startswith("/") or "\0" in path:
        raise FileError(f"sandbox paths are absolute: {path!r}")
    p = PurePosixPath(path)
    if len(p.parts) > 1 and p.parts[1] in RUNTIME_MOUNTS:
        raise FileError(f"{path}: /{p.parts[1]} is the runtime's, not the sandbox's files")
    return p


def _printable(name: str) -> str:
    """A name as text: bytes that are not UTF-8 (a sandbox can make such
    names) become \\xNN escapes instead of breaking the listing."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a directory tree a sandbox wrote (any depth: Python's rmtree
    recurses and a sandbox can nest directories past the recursion limit),
    never crossing into another mount. Missing is fine; failure is logged by
    the caller through the exception."""
    p = subprocess.run(["rm", "-rf", "--one-file-system", "--", os.fspath(path)],
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise OSError(f"cannot remove {os.fspath(path)}: {p.stderr.strip()[-300:]}")


def remove_dir(path: str | os.PathLike[str]) -> None:
    """remove_tree, a failure logged, not raised (a cleanup that must go on)."""
    try:
        remove_tree(path)
    except OSError as e:
        log.warning("%s", e)


def _error(e: OSError, path: str) -> FileError:
    return FileError(f"{path}: {e.strerror}")


def _info(p: PurePosixPath, st: os.stat_result) -> FileInfo:
    kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
            else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
    return FileInfo(name=p.name or "/", path=str(p), type=kind, size=st.st_size,
                    mode=stat.S_IMODE(st.st_mode), mtime=st.st_mtime)


class SandboxFiles:
    """Files of one sandbox root (a directory on the host). owner: the host
    id of the sandbox's root user (a container's user namespace): what is
    written here is its (uid and gid), else the host's root's, an id the
    sandbox does not map."""

    def __init__(self, root: str | os.PathLike[str], owner: int | None = None) -> None:
        self.root = os.fspath(root)
        self.owner = owner

    @contextmanager
    def _dir(self, path: PurePosixPath, *, create: bool = False) -> Iterator[int]:
        rootfd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if create:  # each level resolved from the root, so links stay inside
                for i in range(2, len(path.parts) + 1):
                    parent = _openat2(rootfd, str(PurePosixPath(*path.parts[:i - 1])),
                                      os.O_PATH | os.O_DIRECTORY)
                    try:
                        os.mkdir(path.parts[i - 1], 0o755, dir_fd=parent)
                        if self.owner is not None:
                            os.chown(path.parts[i - 1], self.owner, self.owner, dir_fd=parent,
                                     follow_symlinks=False)
                    except FileExistsError:
                        pass
                    finally:
                        os.close(parent)
            fd = _openat2(rootfd, str(path), os.O_PATH | os.O_DIRECTORY)
            try:
                yield fd
            finally:
                os.close(fd)
        finally:
            os.close(rootfd)

    def read(self, path: str, *, limit: int = MAX_READ) -> bytes:
        p = _clean(path)
        try:
            with self._dir(PurePosixPath("/")) as root:
                # look before opening: opening a device node of the image
                # would run its driver as root on the host
                pfd = _openat2(root, str(p), os.O_PATH)
            try:
                if not stat.S_ISREG(os.fstat(pfd).st_mode):
                    raise FileError(f"{path}: not a regular file")
                fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)
            finally:
                os.close(pfd)
            with os.fdopen(fd, "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            raise _error(e, path) from None
        if len(data) > limit:
            raise FileError(f"{path}: larger than {limit} bytes; use download()")
        return data

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        p = _clean(path)
        if p.name in ("", ".", ".."):
            raise FileError(f"{path}: not a file path")
        tmp = f".{p.name}.lazyfs-{os.getpid()}.tmp"
        try:
            with self._dir(p.parent, create=True) as parent:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, mode, dir_fd=parent)
                try:
                    with os.fdopen(fd, "wb") as f:
                        if self.owner is not None:
                            os.fchown(f.fileno(), self.owner, self.owner)
                        f.write(data)
                    os.chmod(tmp, mode, dir_fd=parent, follow_symlinks=False)
                    os.rename(tmp, p.name, src_dir_fd=parent, dst_dir_fd=parent)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=parent)
                    except OSError:
                        pass
                    raise
        except OSError as e:
            raise _error(e, path) from None

    def list(self, path: str = "/") -> list[FileInfo]:
        p = _clean(path)
        out = []
        try:
            with self._dir(p) as d:
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=d)
                try:
                    entries = []
                    for e in os.scandir(fd):
                        entries.append(e)
                        if len(entries) > MAX_LIST:
                            raise FileError(f"{path}: more than {MAX_LIST} entries")
                    for e in sorted(entries, key=lambda e: e.name):
                        out.append(_info(p / _printable(e.name),
                                         e.stat(follow_symlinks=False)))
                finally:
                    os.close(fd)
        except OSError as e:
            raise _error(e, path) from None
        return out

    def stat(self, path: str) -> FileInfo:
        """The path itself (a symlink, not what it points to), as list()
        describes its entries."""
        p = _clean(path)
        try:
            with self._dir(PurePosixPath("/")) as root:
                fd = _openat2(root, str(p), os.O_PATH | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _error(e, path) from None
        return _info(p, st)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        p = _clean(path)
        if p == PurePosixPath("/"):
            raise FileError("refusing to remove the sandbox's root")
        try:
            with self._dir(p.parent) as parent:
                st = os.stat(p.name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(p.name, dir_fd=parent)
                elif recursive:  # through the resolved parent: no link is followed
                    rm = subprocess.run(["rm", "-rf", "--one-file-system", "--",
                                         f"/proc/self/fd/{parent}/{p.name}"],
                                        pass_fds=(parent,), capture_output=True, text=True,
                                        check=False)
                    if rm.returncode != 0:
                        raise FileError(f"{path}: {rm.stderr.strip()[-200:]}")
                else:
                    os.rmdir(p.name, dir_fd=parent)
        except OSError as e:
            raise _error(e, path) from None

    def exists(self, path: str) -> bool:
        p = _clean(path)
        try:
            with self._dir(PurePosixPath("/")) as root:
                os.close(_openat2(root, str(p), os.O_PATH))
            return True
        except OSError:
            return False
